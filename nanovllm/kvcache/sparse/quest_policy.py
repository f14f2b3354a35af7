"""QUEST: query-aware block selection for decode (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024).

Per host block and layer the policy keeps the element-wise minimum and maximum of the block's
valid keys (``[Hkv, D]`` each, on the compute device), filled by the offload hooks. For a decode
query q, ``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key
of the block. A block's score is the largest bound over all query heads (a block that any head
may need is ranked high: blocks are loaded for all heads at once). When more than
``threshold_blocks`` blocks are available, the ``topk_blocks`` best-scoring blocks are loaded,
plus the first block (attention sink) and the most recent one, which are always kept. Prefill
through QUEST is full attention.
"""
import torch

from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy


def quest_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q.k per block.

    Args:
        q: ``[Hq, D]`` one decode query. kmin, kmax: ``[num_blocks, Hkv, D]``, Hq a multiple of Hkv.
    Returns:
        float32 ``[num_blocks]``: max over query heads of ``sum_d max(q*kmin, q*kmax)``.
    """
    num_blocks, heads_kv, dim = kmin.shape
    qg = q.float().view(heads_kv, -1, dim)  # [Hkv, G, D]
    lo = qg.unsqueeze(0) * kmin.float().unsqueeze(2)  # [N, Hkv, G, D]
    hi = qg.unsqueeze(0) * kmax.float().unsqueeze(2)
    return torch.maximum(lo, hi).sum(-1).flatten(1).amax(1)


def select_top_blocks(scores: torch.Tensor, topk: int) -> list[int]:
    """In increasing order: the first and the last block, plus the ``topk`` best-scoring blocks
    between them."""
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
        shape = (offload_engine.num_layers, offload_engine.num_cpu_blocks, *offload_engine.k_slots.shape[2:])
        device, dtype = offload_engine.device, offload_engine.k_slots.dtype
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)

    def on_prefill_offload(self, cpu_block: int, layer_id: int, k: torch.Tensor, num_tokens: int) -> None:
        self.kmin[layer_id, cpu_block] = k[:num_tokens].amin(0)
        self.kmax[layer_id, cpu_block] = k[:num_tokens].amax(0)

    def on_decode_offload(self, cpu_block: int, k_layers: torch.Tensor) -> None:
        self.kmin[:, cpu_block] = k_layers.amin(1)
        self.kmax[:, cpu_block] = k_layers.amax(1)

    def select_blocks(self, available: list[int], offload_engine, ctx: PolicyContext,
                      q: torch.Tensor) -> list[int]:
        if ctx.is_prefill or len(available) <= self.threshold_blocks:
            return available
        blocks = torch.tensor([ctx.cpu_blocks[i] for i in available], device=self.kmin.device)
        scores = quest_block_scores(q.reshape(-1, q.shape[-1]), self.kmin[ctx.layer_id, blocks],
                                    self.kmax[ctx.layer_id, blocks])
        return [available[i] for i in select_top_blocks(scores, self.topk_blocks)]
