"""QUEST: query-aware page selection for decode, per KV head (Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

Per page of ``page_size`` tokens (the paper's 16) of every full block and layer, the policy keeps
the element-wise minimum and maximum of the page's keys (``[Hkv, D]`` each, on the device), for
the blocks of both tiers (indexed by metadata page, see ``policy.py``): computed from the GPU cache
when a page becomes full (an fp8 cache's keys dequantized), copied along when the block is spilled to the host tier and back
when it is loaded into the GPU tier. Per layer, every KV head scores its candidate pages from its
query heads' upper bounds of ``q . k`` (optionally shrunk towards the key box's center by
``radius_weight``; each head's bounds as a softmax over the candidates,
combined over the GQA group by ``group_score``: "max" or "sum"; ``nanovllm.ops.quest_scores``)
and reads its ``budget_at(layer)`` best (the same at every layer unless weighted by layer,
``choosing.layer_budget_pages``), besides the sink, recent and current pages every sequence
reads (``choosing.py``). Each rank of a tensor-parallel engine chooses for its own KV heads, so no scores are exchanged. Prefill is dense.
"""
import math

import torch

from nanovllm.ops.quest_scores import COMBINES, box_scores, page_scores, top_pages
from nanovllm.sparse.choosing import ChoosingPolicy, most_budget_pages
from nanovllm.sparse.policy import DecodeCandidates, register_policy
from nanovllm.utils.checks import check_range

DEFAULT_TOKEN_BUDGET = 2944
"""``sparse_token_budget``'s default: tokens per KV head and decode step, besides the always-read
ones. With the default 16 sink and 256 recent tokens and the page being written, decode reads at
most 10% of a 32,768-token context's KV (20% of 16,384); docs/sparse.md, "Choosing the defaults"."""
DEFAULT_GROUP_SCORE = "sum"
"""``sparse_group_score``'s default: a KV head ranks its pages by the sum of its query heads'
softmax shares."""
DEFAULT_RADIUS_WEIGHT = 0.5
"""``sparse_radius_weight``'s default: a page's score is its key box's center term plus half of
Quest's radius term (:func:`~nanovllm.ops.quest_scores.box_scores`)."""


@register_policy
class QuestPolicy(ChoosingPolicy):
    """Args: as :class:`~nanovllm.sparse.choosing.ChoosingPolicy`, and group_score ("max" or "sum":
    how a KV head combines its query heads' page shares), radius_weight (in [0, 1]: 1.0 scores a
    page by Quest's upper bound, less shrinks the bound towards the key box's center;
    :func:`~nanovllm.ops.quest_scores.box_scores`), layer_weights (the budget's share per layer,
    :func:`~nanovllm.sparse.choosing.layer_budget_pages`; None: the same budget at every layer).

    Raises:
        ValueError: a value out of range (budget_tokens < 1, group_score not "max" or "sum",
            radius_weight outside [0, 1], bad layer weights, as :class:`ChoosingPolicy`).
    """

    name = "QUEST"
    options = ChoosingPolicy.options + ("sparse_token_budget", "sparse_layer_budget_weights", "sparse_group_score",
                                        "sparse_radius_weight")
    needs_block_metadata = True

    def __init__(self, scale: float, page_size: int = 16, budget_tokens: int = DEFAULT_TOKEN_BUDGET,
                 sink_tokens: int = 16, recent_tokens: int = 256, dense_layers: int = 0,
                 group_score: str = DEFAULT_GROUP_SCORE, radius_weight: float = DEFAULT_RADIUS_WEIGHT,
                 layer_weights=None):
        check_range("sparse_token_budget", budget_tokens, 1)
        if group_score not in COMBINES:
            raise ValueError(f"sparse_group_score must be one of {COMBINES}, got {group_score!r}")
        _check_radius_weight(radius_weight)
        super().__init__(scale, page_size, budget_tokens, sink_tokens, recent_tokens, dense_layers, layer_weights)
        self.group_score, self.radius_weight = group_score, float(radius_weight)
        self.kmin = self.kmax = None
        self.num_gpu_blocks = 0

    @classmethod
    def check_options(cls, config) -> None:
        super().check_options(config)
        check_range("sparse_token_budget", config.sparse_token_budget, 1)
        if config.sparse_group_score not in COMBINES:
            raise ValueError(f"sparse_group_score must be one of {COMBINES}, got {config.sparse_group_score!r}")
        _check_radius_weight(config.sparse_radius_weight)

    @classmethod
    def from_config(cls, config, scale: float) -> "QuestPolicy":
        return cls(scale, config.sparse_page_size, config.sparse_token_budget, config.sparse_sink_tokens,
                   config.sparse_recent_tokens, config.sparse_dense_layers, config.sparse_group_score,
                   config.sparse_radius_weight, config.sparse_layer_budget_weights)

    @classmethod
    def decode_pick_limit(cls, config) -> int:
        """The largest layer budget in whole pages, at most the pages of ``max_model_len`` (no step
        has more candidates)."""
        page = config.sparse_page_size
        pages = most_budget_pages(config.sparse_token_budget, page, config.sparse_layer_budget_weights)
        return min(pages, math.ceil(config.max_model_len / page)) * page

    # ---- metadata ----------------------------------------------------------------------
    def metadata_bytes_per_block(self, num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * (block_size // self.page_size) * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self, num_layers, block_size, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                 num_host_blocks) -> None:
        """Key bounds ``kmin``, ``kmax`` of every page: ``[num_layers, num_gpu_blocks +
        num_host_blocks, pages per block, Hkv, D]``, indexed by metadata slot."""
        shape = (num_layers, num_gpu_blocks + num_host_blocks, block_size // self.page_size, num_kv_heads, head_dim)
        self.kmin, self.kmax = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.num_gpu_blocks = num_gpu_blocks

    def on_pages_full(self, keys: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        pages = keys.view(*keys.shape[:2], -1, self.page_size, *keys.shape[3:])
        self.kmin[:, gpu_ids] = pages.amin(3)
        self.kmax[:, gpu_ids] = pages.amax(3)

    def metadata(self) -> tuple[torch.Tensor, ...]:
        """The per-page metadata tensors, each indexed ``[layer, metadata slot, ...]`` (moved
        with their blocks by :meth:`on_spill` and :meth:`on_load`)."""
        return (self.kmin, self.kmax)

    def on_spill(self, gpu_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        for tensor in self.metadata():
            tensor[:, self.num_gpu_blocks + host_ids] = tensor[:, gpu_ids]

    def on_load(self, host_ids: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        for tensor in self.metadata():
            tensor[:, gpu_ids] = tensor[:, self.num_gpu_blocks + host_ids]

    # ---- choice ------------------------------------------------------------------------
    def select_decode_pages(self, layer: int, q: torch.Tensor, candidates: DecodeCandidates) -> torch.Tensor:
        kmin, kmax = self.kmin[layer].flatten(0, 1), self.kmax[layer].flatten(0, 1)  # [metadata pages, Hkv, D]
        bounds = box_scores(q, kmin, kmax, candidates.pages, self.radius_weight)
        return top_pages(page_scores(bounds, self.scale, kmin.shape[1], self.group_score), self.budget_at(layer))


def _check_radius_weight(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"sparse_radius_weight must be a number in [0, 1], got {value!r}")
