"""QUEST: query-aware block selection for decode (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024).

Per page of ``QUEST_PAGE_SIZE`` tokens (the paper's 16) of every host block and layer, the
policy keeps the element-wise minimum and maximum of the page's valid keys (``[Hkv, D]`` each,
on the compute device), filled by the offload hooks. For a decode query q,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key of the
page. A block's score is the largest bound over its pages and all query heads (a block that any
head may need is ranked high: blocks are loaded for all heads at once, and a bound over a whole
1,024-token block would be too loose to single out a short passage). When more than
``threshold_blocks`` blocks are available, the first block (attention sink) and the most recent
one are loaded, plus the ``topk_blocks`` best-scoring blocks between them (the budget is not
spent on blocks that are loaded anyway: on long prompts they rank first).
Prefill through QUEST is full attention. Selection reads the scores on the host (one sync per
layer and decode step): loads cannot be issued before the layer's query exists anyway. With
tensor parallelism each rank holds a share of the heads; the block scores are all-reduced (max)
so that every rank selects the blocks TP=1 would.
"""
import torch
import torch.distributed as dist

from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy
from nanovllm.utils.distributed import tp_size


QUEST_PAGE_SIZE = 16
"""Tokens per page of key bounds (Quest's default page size)."""


def quest_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q.k per page (or per block).

    Args:
        q: ``[Hq, D]`` one decode query. kmin, kmax: ``[num_pages, Hkv, D]``, Hq a multiple of Hkv.
    Returns:
        float32 ``[num_pages]``: max over query heads of ``sum_d max(q_d*kmin_d, q_d*kmax_d)``,
        computed as ``kmax . max(q, 0) + kmin . min(q, 0)`` (two small matmuls, no
        ``[pages, heads, D]`` temporary).
    """
    num_pages, heads_kv, dim = kmin.shape
    qg = q.float().view(heads_kv, -1, dim)  # [Hkv, G, D]
    upper = torch.einsum("phd,hgd->phg", kmax.float(), qg.clamp(min=0))
    upper += torch.einsum("phd,hgd->phg", kmin.float(), qg.clamp(max=0))
    return upper.flatten(1).amax(1)


def select_top_blocks(scores: torch.Tensor, topk: int) -> list[int]:
    """In increasing order: the first block (attention sink) and the last (most recent), which
    are always loaded, plus the ``topk`` best-scoring blocks between them; every block when
    there are at most ``topk + 2``."""
    n = scores.numel()
    if n <= topk + 2:
        return list(range(n))
    middle = scores[1:n - 1].topk(topk).indices + 1
    return sorted({0, n - 1, *middle.tolist()})


class QuestPolicy(SparsePolicy):
    """Args: scale; topk_blocks (>= 1, besides the first and last block); threshold_blocks
    (select only when more blocks than this are available).

    Raises:
        ValueError: topk_blocks < 1 or threshold_blocks < 0.
    """

    def __init__(self, scale: float, topk_blocks: int = 8, threshold_blocks: int = 4):
        super().__init__(scale)
        if topk_blocks < 1:
            raise ValueError(f"sparse_topk_blocks must be >= 1, got {topk_blocks}")
        if threshold_blocks < 0:
            raise ValueError(f"sparse_threshold_blocks must be >= 0, got {threshold_blocks}")
        self.topk_blocks, self.threshold_blocks = topk_blocks, threshold_blocks
        self.kmin = self.kmax = None

    def initialize(self, offload_engine) -> None:
        block_size = offload_engine.block_size
        self.page_size = min(QUEST_PAGE_SIZE, block_size)
        self.pages_per_block = -(-block_size // self.page_size)
        shape = (offload_engine.num_layers, offload_engine.num_cpu_blocks, self.pages_per_block,
                 *offload_engine.k_slots.shape[2:])
        device, dtype = offload_engine.device, offload_engine.k_slots.dtype
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)
        self.num_valid_pages = torch.zeros(offload_engine.num_cpu_blocks, dtype=torch.int64, device=device)
        self.page_index = torch.arange(self.pages_per_block, device=device)

    def _pages(self, k: torch.Tensor) -> torch.Tensor:
        """``k [n, Hkv, D]`` -> ``[ceil(n / page), page, Hkv, D]``, the last page padded with
        copies of the last key (which leave its min and max unchanged)."""
        pad = -k.size(0) % self.page_size
        if pad:
            k = torch.cat([k, k[-1:].expand(pad, *k.shape[1:])])
        return k.view(-1, self.page_size, *k.shape[1:])

    def on_prefill_offload(self, cpu_block: int, layer_id: int, k: torch.Tensor, num_tokens: int) -> None:
        pages = self._pages(k[:num_tokens])
        self.kmin[layer_id, cpu_block, :pages.size(0)] = pages.amin(1)
        self.kmax[layer_id, cpu_block, :pages.size(0)] = pages.amax(1)
        self.num_valid_pages[cpu_block] = pages.size(0)

    def on_decode_offload(self, cpu_block: int, k_layers: torch.Tensor) -> None:
        pages = k_layers.view(k_layers.size(0), self.pages_per_block, self.page_size, *k_layers.shape[2:])
        self.kmin[:, cpu_block] = pages.amin(2)
        self.kmax[:, cpu_block] = pages.amax(2)
        self.num_valid_pages[cpu_block] = self.pages_per_block

    def _selects(self, num_blocks: int) -> bool:
        """Whether a decode step over ``num_blocks`` blocks loads fewer than all of them."""
        return num_blocks > self.threshold_blocks and num_blocks > self.topk_blocks + 2

    def blocks_before_query(self, ctx: PolicyContext) -> list[int]:
        n = len(ctx.cpu_blocks)
        return [0, n - 1] if self._selects(n) else list(range(n))

    def select_blocks(self, available: list[int], offload_engine, ctx: PolicyContext,
                      q: torch.Tensor) -> list[int]:
        if ctx.is_prefill or not self._selects(len(available)):
            return available
        ids = torch.tensor([ctx.cpu_blocks[i] for i in available], pin_memory=self.kmin.is_cuda)
        blocks = ids.to(self.kmin.device, non_blocking=True)
        kmin, kmax = self.kmin[ctx.layer_id, blocks], self.kmax[ctx.layer_id, blocks]
        page_scores = quest_block_scores(q.reshape(-1, q.shape[-1]), kmin.flatten(0, 1), kmax.flatten(0, 1))
        page_scores = page_scores.view(len(available), self.pages_per_block)
        valid = self.page_index < self.num_valid_pages[blocks, None]
        scores = page_scores.masked_fill(~valid, float("-inf")).amax(1)
        if tp_size() > 1:  # this rank's heads -> all heads: every rank selects TP=1's blocks
            dist.all_reduce(scores, op=dist.ReduceOp.MAX)
        return [available[i] for i in select_top_blocks(scores, self.topk_blocks)]
