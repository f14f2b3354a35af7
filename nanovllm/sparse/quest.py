"""QUEST: query-aware block selection for decode (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024).

Per page of ``QUEST_PAGE_SIZE`` tokens (the paper's 16) of every full block and layer, the policy
keeps the element-wise minimum and maximum of the page's keys (``[Hkv, D]`` each, on the device),
for the blocks of both tiers: computed from the GPU cache when a block becomes full and copied
along when the block is spilled to the host tier. For a decode query q,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key of the
page. A block's score is the largest bound over its pages and all query heads (blocks are read for
all heads at once). When a sequence has more than ``threshold_blocks`` blocks (and more than
``topk_blocks + 2``), its first block (attention sink), its last full block and the block being
written (the most recent tokens: a prompt's question, the answer so far) are read, plus the
``topk_blocks`` best-scoring blocks between the first and the last full one. Prefill is dense.
With tensor parallelism each rank holds a share of the heads; the scores are all-reduced (max) so
that every rank selects the blocks TP=1 would.
"""
import torch
import torch.distributed as dist

from nanovllm.sparse.policy import DecodeBlocks, SparsePolicy
from nanovllm.utils.distributed import tp_size

QUEST_PAGE_SIZE = 16
"""Tokens per page of key bounds (Quest's default page size)."""


def quest_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q.k per block, over its pages and all query heads.

    Args:
        q: ``[S, Hq, D]``, one decode query per sequence.
        kmin, kmax: ``[S, M, P, Hkv, D]``, the key bounds of ``P`` pages of ``M`` blocks per
            sequence, Hq a multiple of Hkv.

    Returns:
        float32 ``[S, M]``: max over pages and query heads of ``sum_d max(q_d*kmin_d, q_d*kmax_d)``,
        computed as ``kmax . max(q, 0) + kmin . min(q, 0)`` (no ``[.., heads, D]`` temporary).
    """
    seqs, heads_q, dim = q.shape
    heads_kv = kmin.shape[-2]
    qg = q.float().view(seqs, heads_kv, heads_q // heads_kv, dim)
    upper = torch.einsum("smphd,shgd->smphg", kmax.float(), qg.clamp(min=0))
    upper += torch.einsum("smphd,shgd->smphg", kmin.float(), qg.clamp(max=0))
    return upper.flatten(2).amax(2)


def select_top_blocks(scores: torch.Tensor, num_blocks: list[int], num_full: list[int], topk: int) -> list[list[int]]:
    """Per row of ``scores`` ``[S, M]`` (a sequence of ``num_blocks[s]`` blocks, the first
    ``num_full[s]`` of them full): the first block (attention sink), the last full block and the
    block being written (the most recent tokens), plus the ``topk`` best-scoring blocks between
    the first and the last full one; increasing. Every block when there are at most ``topk`` such
    candidates. One host sync."""
    columns = torch.arange(scores.shape[1], device=scores.device)
    last_full = torch.tensor(num_full, device=scores.device)[:, None] - 1
    middle = (columns > 0) & (columns < last_full)
    k = min(topk, scores.shape[1])
    best = scores.masked_fill(~middle, float("-inf")).topk(k, dim=1).indices.tolist()
    return [list(range(n)) if full - 2 <= topk else sorted({0, full - 1, n - 1, *row})
            for n, full, row in zip(num_blocks, num_full, best)]


class QuestPolicy(SparsePolicy):
    """Args: scale; topk_blocks (>= 1, besides the first and last block); threshold_blocks
    (select only when more blocks than this are available).

    Raises:
        ValueError: topk_blocks < 1 or threshold_blocks < 0.
    """

    chooses_decode_blocks = needs_block_metadata = True

    def __init__(self, scale: float, topk_blocks: int = 8, threshold_blocks: int = 4):
        super().__init__(scale)
        if topk_blocks < 1:
            raise ValueError(f"sparse_topk_blocks must be >= 1, got {topk_blocks}")
        if threshold_blocks < 0:
            raise ValueError(f"sparse_threshold_blocks must be >= 0, got {threshold_blocks}")
        self.topk_blocks, self.threshold_blocks = topk_blocks, threshold_blocks
        self.bounds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def metadata_bytes_per_block(self, num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * (block_size // QUEST_PAGE_SIZE) * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self, num_layers, block_size, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                 num_host_blocks) -> None:
        """Key bounds ``(kmin, kmax)`` of every page, ``[num_layers, blocks, pages, Hkv, D]`` per tier."""
        pages = block_size // QUEST_PAGE_SIZE
        self.bounds = {tier: tuple(torch.zeros(num_layers, n, pages, num_kv_heads, head_dim, dtype=dtype,
                                               device=device) for _ in range(2))
                       for tier, n in (("gpu", num_gpu_blocks), ("host", num_host_blocks))}

    def on_blocks_full(self, k_cache: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        keys = k_cache[:, gpu_ids]  # [L, n, B, Hkv, D]
        pages = keys.view(*keys.shape[:2], -1, QUEST_PAGE_SIZE, *keys.shape[3:])
        kmin, kmax = self.bounds["gpu"]
        kmin[:, gpu_ids] = pages.amin(3)
        kmax[:, gpu_ids] = pages.amax(3)

    def on_spill(self, gpu_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        for host, gpu in zip(self.bounds["host"], self.bounds["gpu"]):
            host[:, host_ids] = gpu[:, gpu_ids]

    def selects(self, num_blocks: int) -> bool:
        return num_blocks > self.threshold_blocks and num_blocks > self.topk_blocks + 2

    def _bounds(self, layer: int, blocks: DecodeBlocks) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` ``[S, M, pages, Hkv, D]`` of every listed block, from its tier."""
        on_gpu = (blocks.gpu_ids >= 0)[:, :, None, None, None]
        out = []
        for gpu, host in zip(self.bounds["gpu"], self.bounds["host"]):
            from_gpu = gpu[layer][blocks.gpu_ids.clamp(min=0)]
            from_host = host[layer][blocks.host_ids.clamp(min=0)] if host.shape[1] else from_gpu
            out.append(torch.where(on_gpu, from_gpu, from_host))
        return out[0], out[1]

    def select_decode_blocks(self, layer: int, q: torch.Tensor, blocks: DecodeBlocks) -> list[list[int]]:
        scores = quest_block_scores(q, *self._bounds(layer, blocks))
        if tp_size() > 1:  # this rank's heads -> all heads: every rank selects TP=1's blocks
            dist.all_reduce(scores, op=dist.ReduceOp.MAX)
        return select_top_blocks(scores, blocks.num_blocks, blocks.num_full_blocks, self.topk_blocks)
