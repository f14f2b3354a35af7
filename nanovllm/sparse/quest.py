"""QUEST: query-aware block selection for decode (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024).

Per page of ``QUEST_PAGE_SIZE`` tokens (the paper's 16) of every full block and layer, the policy
keeps the element-wise minimum and maximum of the page's keys (``[Hkv, D]`` each, on the device),
for the blocks of both tiers (indexed by metadata slot, see ``policy.py``): computed from the GPU
cache when a block becomes full and copied along when the block is spilled to the host tier. A
block's score for a decode query combines every query head's upper bound of ``q . k`` over the
block's pages: the sum over heads of each head's softmax of its bounds over the candidate blocks
(``nanovllm.ops.quest_scores``). When a sequence has more than ``threshold_blocks`` blocks (and
more than ``topk_blocks + 3``), its first block (attention sink) and its two last blocks (the
block being written and the one before it: the most recent tokens, a prompt's question, the answer
so far) are read whatever the query, plus the ``topk_blocks`` best-scoring blocks between them.
Prefill is dense. With tensor parallelism each rank holds a share of the heads; the scores (sums
over heads) are all-reduced (sum) so that every rank selects the blocks TP=1 would.
"""
import torch
import torch.distributed as dist

from nanovllm.ops.quest_scores import block_scores, quest_bounds, select_top_blocks, top_blocks
from nanovllm.parallel.process_group import tp_size
from nanovllm.sparse.policy import DecodeBlocks, SparsePolicy, register_policy
from nanovllm.utils.checks import check_range

QUEST_PAGE_SIZE = 16
"""Tokens per page of key bounds (Quest's default page size)."""


@register_policy
class QuestPolicy(SparsePolicy):
    """Args: scale; topk_blocks (>= 1, besides the first and the two last blocks); threshold_blocks
    (select only when more blocks than this are available).

    Raises:
        ValueError: topk_blocks < 1 or threshold_blocks < 0.
    """

    name = "QUEST"
    options = ("sparse_topk_blocks", "sparse_threshold_blocks")
    chooses_decode_blocks = needs_block_metadata = True

    @classmethod
    def check_options(cls, config) -> None:
        check_range("sparse_topk_blocks", config.sparse_topk_blocks, 1)
        check_range("sparse_threshold_blocks", config.sparse_threshold_blocks, 0)

    @classmethod
    def from_config(cls, config, scale: float) -> "QuestPolicy":
        return cls(scale, config.sparse_topk_blocks, config.sparse_threshold_blocks)

    @classmethod
    def decode_pick_limit(cls, config) -> int:
        return config.sparse_topk_blocks

    def __init__(self, scale: float, topk_blocks: int = 16, threshold_blocks: int = 4):
        super().__init__(scale)
        check_range("sparse_topk_blocks", topk_blocks, 1)
        check_range("sparse_threshold_blocks", threshold_blocks, 0)
        self.topk_blocks, self.threshold_blocks = topk_blocks, threshold_blocks
        self.kmin = self.kmax = None
        self.num_gpu_blocks = 0

    def metadata_bytes_per_block(self, num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * (block_size // QUEST_PAGE_SIZE) * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self, num_layers, block_size, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                 num_host_blocks) -> None:
        """Key bounds ``kmin``, ``kmax`` of every page: ``[num_layers, num_gpu_blocks +
        num_host_blocks, pages, Hkv, D]``, indexed by metadata slot."""
        shape = (num_layers, num_gpu_blocks + num_host_blocks, block_size // QUEST_PAGE_SIZE, num_kv_heads, head_dim)
        self.kmin, self.kmax = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.num_gpu_blocks = num_gpu_blocks

    def on_blocks_full(self, k_cache: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        keys = k_cache[:, gpu_ids]  # [L, n, B, Hkv, D]
        pages = keys.view(*keys.shape[:2], -1, QUEST_PAGE_SIZE, *keys.shape[3:])
        self.kmin[:, gpu_ids] = pages.amin(3)
        self.kmax[:, gpu_ids] = pages.amax(3)

    def on_spill(self, gpu_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        for bounds in (self.kmin, self.kmax):
            bounds[:, self.num_gpu_blocks + host_ids] = bounds[:, gpu_ids]

    def on_load(self, host_ids: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        for bounds in (self.kmin, self.kmax):
            bounds[:, gpu_ids] = bounds[:, self.num_gpu_blocks + host_ids]

    def selects(self, num_blocks: int) -> bool:
        return num_blocks > self.threshold_blocks and num_blocks > self.topk_blocks + 3

    def fixed_decode_blocks(self, num_blocks: int) -> list[int]:
        return [0, num_blocks - 2, num_blocks - 1]

    def max_decode_picks(self, num_candidates: int) -> int:
        return min(self.topk_blocks, num_candidates)

    def select_decode_blocks(self, layer: int, q: torch.Tensor, blocks: DecodeBlocks) -> torch.Tensor:
        bounds = quest_bounds(q, self.kmin[layer], self.kmax[layer], blocks.slots)
        if tp_size() == 1:
            return top_blocks(bounds, self.scale, self.topk_blocks)
        scores = block_scores(bounds, self.scale)
        dist.all_reduce(scores, op=dist.ReduceOp.SUM)  # this rank's heads -> all heads: TP=1's blocks
        return select_top_blocks(scores, self.topk_blocks)
