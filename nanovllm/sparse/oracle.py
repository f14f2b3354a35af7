"""ORACLE: decode pages chosen by their exact attention mass, the ceiling of per-KV-head page
selection at a budget (the "oracle top-k" baseline of Quest, Tang et al., ICML 2024, and of the
sparse-attention studies that follow it).

The policy keeps a copy of every full page's keys (``[page_size, Hkv, D]`` per page, for the
blocks of both tiers, on the device) and, per layer and KV head, reads the ``budget_pages``
candidates on which its query heads' softmax attention puts the most mass: a page's logit is the
``logsumexp`` of ``scale * q . k`` over its keys, so :func:`~nanovllm.ops.quest_scores.page_scores`
turns the logits into each query head's exact share of the candidates' attention, combined over
the GQA group as QUEST combines its bounds ("max" or "sum"). The fixed pages (sinks, recent
window, the page being written) are read as for every choosing policy. Choosing reads every key
of every candidate, so the policy measures what a selector could reach; it saves no time.
"""
import torch

from nanovllm.ops.quest_scores import page_scores, top_pages
from nanovllm.sparse.policy import DecodeCandidates, register_policy
from nanovllm.sparse.quest import QuestPolicy


@register_policy
class OraclePolicy(QuestPolicy):
    """Args and errors: as :class:`~nanovllm.sparse.quest.QuestPolicy` (its options but the radius
    weight: page size, token budget, sinks, recent window, dense layers, group score); the pages
    are scored by their exact attention mass instead of QUEST's key bounds."""

    name = "ORACLE"
    options = tuple(option for option in QuestPolicy.options if option != "sparse_radius_weight")  # exact scores
    choice_in_graphs = False  # it reads every candidate's keys: padded to max_model_len, too large to capture

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys = None

    def metadata_bytes_per_block(self, num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self, num_layers, block_size, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                 num_host_blocks) -> None:
        """The keys of every page: ``[num_layers, num_gpu_blocks + num_host_blocks, pages per
        block, page_size, Hkv, D]``, indexed by metadata slot."""
        self.keys = torch.zeros(num_layers, num_gpu_blocks + num_host_blocks, block_size // self.page_size,
                                self.page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.num_gpu_blocks = num_gpu_blocks

    def metadata(self) -> tuple[torch.Tensor, ...]:
        return (self.keys,)

    def on_pages_full(self, keys: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        self.keys[:, gpu_ids] = keys.view(*keys.shape[:2], -1, self.page_size, *keys.shape[3:])

    def select_decode_pages(self, layer: int, q: torch.Tensor, candidates: DecodeCandidates) -> torch.Tensor:
        keys = self.keys[layer].flatten(0, 1)[candidates.pages.clamp(min=0)]  # [S, C, P, Hkv, D]
        seqs, heads_q, dim = q.shape
        heads_kv = keys.shape[3]
        qg = q.float().view(seqs, heads_kv, heads_q // heads_kv, dim)
        logits = torch.einsum("scphd,shgd->scphg", keys.float(), qg) * self.scale
        page_logits = logits.logsumexp(2).flatten(2) / self.scale  # [S, C, Hq], in page_bounds' units
        page_logits.masked_fill_((candidates.pages < 0)[..., None], float("-inf"))
        return top_pages(page_scores(page_logits, self.scale, heads_kv, self.group_score), self.budget_at(layer))
