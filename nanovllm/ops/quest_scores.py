"""QUEST's block scores for decode queries (Tang et al., "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", ICML 2024), one set of blocks for all heads of a layer.

For a page of keys with element-wise bounds ``kmin``, ``kmax`` (``[Hkv, D]``) and a query ``q``,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key of the
page; it equals ``kmax . max(q, 0) + kmin . min(q, 0)``. A block's bound for a query head is the
largest over its pages (GQA: a query head uses its KV head's bounds).

The paper selects pages per head. Here one selection serves every head of the layer, so the heads'
bounds are combined (:func:`block_scores`): each head's bounds (times the softmax scale) become a
softmax over the candidate blocks, that head's estimate of how its attention divides among them,
and a block's score is the sum of these shares over the heads. Taking the largest bound over heads
instead lets any head whose bounds are large everywhere decide the selection, which costs accuracy
(docs/sparse.md, 'QUEST: the per-head score').

:func:`quest_bounds` computes the bounds of the candidate blocks of a decode batch straight from
one layer's bounds: on CUDA one Triton kernel (a program per (sequence, block, KV head) walks the
block's pages; two ``tl.dot`` per tile with fp32 accumulation, the GQA group padded to 16 rows),
so the bounds are read once and nothing is gathered or converted first; on CPU
:func:`quest_bounds_ref`.
"""
import torch

from nanovllm.ops._triton import (MIN_DOT_ROWS, block_dim, check_gqa, check_head_dim, interpreted, next_pow2,
                                  row_tile, tl, triton, use_triton)

_BLOCK_P = 64
"""Pages per tile."""
_NUM_WARPS = 4


def quest_head_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q.k per block and query head, over the block's pages (plain torch).

    Args:
        q: ``[S, Hq, D]``, one decode query per sequence.
        kmin, kmax: ``[S, M, P, Hkv, D]``, the key bounds of ``P`` pages of ``M`` blocks per
            sequence, Hq a multiple of Hkv.

    Returns:
        float32 ``[S, M, Hq]``: max over pages of ``sum_d max(q_d*kmin_d, q_d*kmax_d)``, computed
        as ``kmax . max(q, 0) + kmin . min(q, 0)`` (no ``[.., heads, D]`` temporary).
    """
    seqs, heads_q, dim = q.shape
    heads_kv = kmin.shape[-2]
    qg = q.float().view(seqs, heads_kv, heads_q // heads_kv, dim)
    upper = torch.einsum("smphd,shgd->smphg", kmax.float(), qg.clamp(min=0))
    upper += torch.einsum("smphd,shgd->smphg", kmin.float(), qg.clamp(max=0))
    return upper.amax(2).flatten(2)


def block_scores(bounds: torch.Tensor, scale: float) -> torch.Tensor:
    """One score per candidate block from every head's bounds (module docstring).

    Args:
        bounds: float32 ``[S, M, Hq]`` from :func:`quest_bounds`, -inf for blocks that are not
            candidates (for every head).
        scale: the attention's softmax scale.

    Returns:
        float32 ``[S, M]``: per head, ``softmax`` over the candidate blocks of ``scale *
        bounds``, summed over heads (in ``[0, Hq]``); -inf where a block is not a candidate.
    """
    shares = torch.softmax(bounds * scale, dim=1).nan_to_num_(0.0)  # a row without candidates: 0/0
    return shares.sum(2).masked_fill_(torch.isneginf(bounds[..., 0]), float("-inf"))


def select_top_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row of ``scores`` ``[S, M]`` (-inf: not a candidate), the columns of the ``topk`` best
    candidates as int64 ``[S, min(topk, M)]``, best first, -1 where a row has fewer candidates. No
    host sync."""
    values, columns = scores.topk(min(topk, scores.shape[1]), dim=1)
    return columns.masked_fill(values == float("-inf"), -1)


def top_blocks_ref(bounds: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """Reference of :func:`top_blocks`: :func:`block_scores`, then :func:`select_top_blocks`."""
    return select_top_blocks(block_scores(bounds, scale), topk)


_MAX_TOP_BLOCKS_TILE = 16384
"""Most candidate blocks (rounded up to a power of two) :func:`top_blocks` holds in one program;
beyond, :func:`top_blocks_ref` runs (2M tokens at 128-token blocks)."""
_TOP_BLOCKS_TILE_ELEMS = 4096
"""Bounds per tile of :func:`top_blocks` (blocks x heads)."""


@triton.jit(do_not_specialize=["num_blocks", "num_heads"])
def _top_blocks_kernel(bounds_ptr, picks_ptr, num_blocks, num_heads, scale, stride_bs, stride_bm, stride_ps,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program s: sequence s's block scores (a softmax over its blocks per head, summed over heads),
    then its K best blocks by repeated arg-max (the lowest column first among equal scores)."""
    s = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < num_blocks
    rows = bounds_ptr + s * stride_bs + m[:, None] * stride_bm
    score = tl.zeros([BLOCK_M], tl.float32)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(rows + h[None, :], mask=m_mask[:, None] & (h < num_heads)[None, :], other=float("-inf")) * scale
        top = tl.max(x, 0)
        e = tl.exp(x - tl.where(top == float("-inf"), 0.0, top)[None, :])  # -inf (not a candidate): 0
        total = tl.sum(e, 0)
        score += tl.sum(e / tl.where(total > 0, total, 1.0)[None, :], 1)  # a row without candidates: 0
    first = tl.load(bounds_ptr + s * stride_bs + m * stride_bm, mask=m_mask, other=float("-inf"))
    score = tl.where(first == float("-inf"), float("-inf"), score)
    for i in tl.static_range(K):
        best = tl.max(score, 0)
        column = tl.min(tl.where(score == best, m, BLOCK_M), 0)
        tl.store(picks_ptr + s * stride_ps + i, tl.where(best == float("-inf"), -1, column).to(tl.int64))
        score = tl.where(m == column, float("-inf"), score)


def top_blocks(bounds: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """The ``topk`` best-scoring candidate blocks of each sequence from its heads' bounds:
    :func:`select_top_blocks` of :func:`block_scores` in one launch.

    Args:
        bounds: float32 ``[S, M, Hq]`` from :func:`quest_bounds`, -inf for blocks that are not
            candidates (for every head).
        scale: the attention's softmax scale.
        topk: blocks to pick per sequence, >= 1.

    Returns:
        int64 ``[S, min(topk, M)]``: columns of ``bounds``, best first, -1 where a sequence has
        fewer candidates. Equal to :func:`top_blocks_ref` but where two scores are within float
        rounding (the scores are summed in another order; among equal scores the lower column
        comes first).

    Raises:
        ValueError: bounds not float32 ``[S, M, Hq]`` or topk < 1.

    CUDA: one Triton launch, a program per sequence holding its ``M`` scores (heads in tiles of
    ``_TOP_BLOCKS_TILE_ELEMS`` bounds), so that a decode layer's selection costs one launch
    instead of ~10 torch ops; M beyond ``_MAX_TOP_BLOCKS_TILE`` or no Triton:
    :func:`top_blocks_ref`.
    """
    if bounds.dim() != 3 or bounds.dtype != torch.float32:
        raise ValueError(f"bounds must be float32 [S, M, Hq]; got {bounds.dtype} {tuple(bounds.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    seqs, num_blocks, heads = bounds.shape
    interpret = interpreted(bounds)
    block_m = row_tile(num_blocks, interpret)
    if not use_triton(bounds) or block_m > _MAX_TOP_BLOCKS_TILE or not seqs * num_blocks * heads:
        return top_blocks_ref(bounds, scale, topk)
    picks = torch.empty(seqs, min(topk, num_blocks), dtype=torch.int64, device=bounds.device)
    bounds = bounds if bounds.stride(2) == 1 else bounds.contiguous()
    _top_blocks_kernel[(seqs,)](
        bounds, picks, num_blocks, heads, scale, bounds.stride(0), bounds.stride(1), picks.stride(0),
        K=picks.shape[1], BLOCK_M=block_m, BLOCK_H=max(1, min(next_pow2(heads), _TOP_BLOCKS_TILE_ELEMS // block_m)),
        num_warps=4 if block_m <= 1024 else 8,
    )
    return picks


def _check_args(q, kmin, kmax, slots) -> None:
    if q.dim() != 3 or kmin.dim() != 4 or kmin.shape != kmax.shape or q.shape[2] != kmin.shape[3]:
        raise ValueError(f"expected q [S, Hq, D] and kmin, kmax [num_slots, P, Hkv, D] with one D; got q "
                         f"{tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    check_gqa(q.shape[1], kmin.shape[2])
    check_head_dim(q.shape[2])
    if slots.dim() != 2 or slots.shape[0] != q.shape[0] or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 [S={q.shape[0]}, M]; got {slots.dtype} {tuple(slots.shape)}")


def quest_bounds_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`quest_bounds` (same arguments and result): the bounds gathered per
    block, then :func:`quest_head_bounds`."""
    _check_args(q, kmin, kmax, slots)
    index = slots.clamp(min=0)
    bounds = quest_head_bounds(q, kmin[index], kmax[index])
    return bounds.masked_fill((slots < 0)[..., None], float("-inf"))


@triton.jit(do_not_specialize=["num_blocks", "stride_ss", "stride_os"])  # one variant whatever the batch
def _quest_bounds_kernel(
    q_ptr, kmin_ptr, kmax_ptr, slots_ptr, out_ptr, num_blocks, num_pages,
    stride_qs, stride_qh, stride_bs, stride_bp, stride_bh, stride_ss, stride_os, stride_om,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0) // num_blocks
    block = tl.program_id(0) % num_blocks
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    out = out_ptr + seq * stride_os + block * stride_om + kv_head * GROUP + g
    slot = tl.load(slots_ptr + seq * stride_ss + block)
    if slot < 0:
        tl.store(out, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_mask)
    else:
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = tl.maximum(q, 0.0).to(kmax_ptr.dtype.element_ty)  # exact in q's dtype
        q_neg = tl.minimum(q, 0.0).to(kmax_ptr.dtype.element_ty)
        base = slot.to(tl.int64) * stride_bs + kv_head * stride_bh
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for p0 in range(0, num_pages, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_mask = p < num_pages
            offsets = base + p[:, None] * stride_bp + d[None, :]
            mask = p_mask[:, None] & d_mask[None, :]
            kmax = tl.load(kmax_ptr + offsets, mask=mask, other=0.0)
            kmin = tl.load(kmin_ptr + offsets, mask=mask, other=0.0)
            bound = tl.dot(q_pos, tl.trans(kmax), input_precision=DOT_PRECISION)
            bound = tl.dot(q_neg, tl.trans(kmin), bound, input_precision=DOT_PRECISION)
            best = tl.maximum(best, tl.max(tl.where(p_mask[None, :], bound, float("-inf")), 1))
        tl.store(out, best, mask=g_mask)


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """QUEST bounds of the candidate blocks of a decode batch per query head, from one layer's
    key bounds.

    Args:
        q: ``[S, Hq, D]``, one decode query per sequence, float16/bfloat16/float32, ``D <= 256``.
        kmin, kmax: ``[num_slots, P, Hkv, D]`` (q's dtype), the element-wise key bounds of ``P``
            pages of every block, indexed by metadata slot; head_dim contiguous; Hq % Hkv == 0.
        slots: int64 ``[S, M]``: the slot of each candidate block of each sequence, -1 for none.

    Returns:
        float32 ``[S, M, Hq]``: max over the block's pages of ``kmax . max(q, 0) + kmin . min(q,
        0)``; -inf where ``slots`` is -1. Equal to :func:`quest_bounds_ref` up to float summation
        order (products of half-precision values are exact in fp32).

    Raises:
        ValueError: shapes or dtypes that disagree, Hq not a multiple of Hkv, D outside 1..256.

    CUDA: one launch over ``S * M * Hkv`` programs. CPU (or float64): :func:`quest_bounds_ref`.
    """
    _check_args(q, kmin, kmax, slots)
    if q.dtype == torch.float64 or not use_triton(q):
        return quest_bounds_ref(q, kmin, kmax, slots)
    seqs, heads_q, dim = q.shape
    num_blocks, (_, num_pages, heads_kv, _) = slots.shape[1], kmin.shape
    bounds = torch.empty(seqs, num_blocks, heads_q, dtype=torch.float32, device=q.device)
    if seqs * num_blocks == 0:
        return bounds
    if kmin.stride(-1) != 1 or kmax.stride() != kmin.stride() or q.stride(-1) != 1 or not slots.is_contiguous():
        q, kmin, kmax, slots = q.contiguous(), kmin.contiguous(), kmax.contiguous(), slots.contiguous()
    group = heads_q // heads_kv
    _quest_bounds_kernel[(seqs * num_blocks, heads_kv)](
        q, kmin, kmax, slots, bounds, num_blocks, num_pages,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), slots.stride(0),
        bounds.stride(0), bounds.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(MIN_DOT_ROWS, next_pow2(group)), BLOCK_D=block_dim(dim),
        BLOCK_P=_BLOCK_P, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=_NUM_WARPS,
    )
    return bounds
