"""MOMENTS: decode pages chosen by a Gaussian estimate of their attention mass from the mean and
variance of their keys.

QUEST scores a page by the upper bound of ``q . k`` over the box of its keys: a worst case, which
grows with the page's spread in every dimension whether or not one key is large in all of them.
This policy keeps, per page of ``page_size`` tokens and KV head, the mean ``mu`` and the variance
``var`` of its keys in every dimension (``[Hkv, D]`` each, the same bytes as QUEST's bounds, for
the blocks of both tiers) and estimates the page's share of a query head's attention by the
log-sum-exp of its scores under a Gaussian model of its keys with diagonal covariance: for
``k ~ N(mu, diag(var))``, ``log E[exp(s q . k)] = s q . mu + s^2 (q^2 . var) / 2``, so a page of P
keys has ``logsumexp_n(s q . k_n) ~ log P + s q . mu + s^2 (q^2 . var) / 2`` (every candidate is a
full page, so ``log P`` does not rank). The page logits become shares and picks as QUEST's
(``nanovllm.ops.quest_scores.page_scores``, ``top_pages``): per query head a softmax over the
candidates, combined over the GQA group by ``group_score``. The two dot products reuse QUEST's
bound kernel (``page_bounds`` with equal lower and upper arguments is a plain dot product).
"""
import torch

from nanovllm.ops.quest_scores import page_bounds, page_scores, top_pages
from nanovllm.sparse.policy import DecodeCandidates, register_policy
from nanovllm.sparse.quest import QuestPolicy


@register_policy
class MomentsPolicy(QuestPolicy):
    """Args and errors: as :class:`~nanovllm.sparse.quest.QuestPolicy` but the radius weight (page
    size, token budget, sinks, recent window, dense layers, group score); a page is scored by the
    Gaussian estimate of its log-sum-exp (module docstring) instead of QUEST's bound."""

    name = "MOMENTS"
    options = tuple(option for option in QuestPolicy.options if option != "sparse_radius_weight")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mean = self.var = None

    def allocate(self, num_layers, block_size, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                 num_host_blocks) -> None:
        """Key means and variances of every page: ``[num_layers, num_gpu_blocks + num_host_blocks,
        pages per block, Hkv, D]``, indexed by metadata slot."""
        shape = (num_layers, num_gpu_blocks + num_host_blocks, block_size // self.page_size, num_kv_heads, head_dim)
        self.mean, self.var = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.num_gpu_blocks = num_gpu_blocks

    def metadata(self) -> tuple[torch.Tensor, ...]:
        return (self.mean, self.var)

    def on_pages_full(self, keys: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        pages = keys.view(*keys.shape[:2], -1, self.page_size, *keys.shape[3:]).float()
        var, mean = torch.var_mean(pages, dim=3, correction=0)
        self.mean[:, gpu_ids] = mean.to(self.mean.dtype)
        self.var[:, gpu_ids] = var.to(self.var.dtype)

    def select_decode_pages(self, layer: int, q: torch.Tensor, candidates: DecodeCandidates) -> torch.Tensor:
        mean, var = self.mean[layer].flatten(0, 1), self.var[layer].flatten(0, 1)  # [metadata pages, Hkv, D]
        logits = page_bounds(q, mean, mean, candidates.pages)  # q . mu
        spread = page_bounds(q * q, var, var, candidates.pages)  # q^2 . var
        logits = logits + spread * (0.5 * self.scale)  # in page_bounds' units; -inf stays -inf
        return top_pages(page_scores(logits, self.scale, mean.shape[1], self.group_score), self.budget_at(layer))
