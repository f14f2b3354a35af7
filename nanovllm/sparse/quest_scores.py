"""QUEST's block scores for decode queries (Tang et al., "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", ICML 2024).

For a page of keys with element-wise bounds ``kmin``, ``kmax`` (``[Hkv, D]``) and a query ``q``,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key of the
page; it equals ``kmax . max(q, 0) + kmin . min(q, 0)``. A block's score is the largest bound over
its pages and all query heads (GQA: a query head uses its KV head's bounds).

:func:`quest_scores` scores the candidate blocks of a decode batch straight from the bounds of one
layer, indexed by metadata slot: on CUDA one Triton kernel (a program per (sequence, block, KV
head) walks the block's pages; two ``tl.dot`` per tile with fp32 accumulation, the GQA group
padded to 16 rows), so the bounds are read once and nothing is gathered or converted first; on
CPU :func:`quest_scores_ref`.
"""
import torch

from nanovllm.ops._triton import (MIN_DOT_ROWS, block_dim, check_gqa, check_head_dim, next_pow2, tl, triton,
                                  use_triton)

_BLOCK_P = 64
"""Pages per tile."""
_NUM_WARPS = 4


def quest_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q.k per block, over its pages and all query heads (plain torch).

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


def _check_args(q, kmin, kmax, slots) -> None:
    if q.dim() != 3 or kmin.dim() != 4 or kmin.shape != kmax.shape or q.shape[2] != kmin.shape[3]:
        raise ValueError(f"expected q [S, Hq, D] and kmin, kmax [num_slots, P, Hkv, D] with one D; got q "
                         f"{tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    check_gqa(q.shape[1], kmin.shape[2])
    check_head_dim(q.shape[2])
    if slots.dim() != 2 or slots.shape[0] != q.shape[0] or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 [S={q.shape[0]}, M]; got {slots.dtype} {tuple(slots.shape)}")


def quest_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`quest_scores` (same arguments and result): the bounds gathered per
    block, then :func:`quest_block_scores`."""
    _check_args(q, kmin, kmax, slots)
    index = slots.clamp(min=0)
    scores = quest_block_scores(q, kmin[index], kmax[index])
    return scores.masked_fill(slots < 0, float("-inf"))


@triton.jit(do_not_specialize=["num_blocks", "stride_ss", "stride_os"])  # one variant whatever the batch
def _quest_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, slots_ptr, out_ptr, num_blocks, num_pages,
    stride_qs, stride_qh, stride_bs, stride_bp, stride_bh, stride_ss, stride_os, stride_om,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0) // num_blocks
    block = tl.program_id(0) % num_blocks
    kv_head = tl.program_id(1)
    out = out_ptr + seq * stride_os + block * stride_om + kv_head
    slot = tl.load(slots_ptr + seq * stride_ss + block)
    if slot < 0:
        tl.store(out, float("-inf"))
    else:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_mask, d_mask = g < GROUP, d < HEAD_DIM
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
        tl.store(out, tl.max(tl.where(g_mask, best, float("-inf")), 0))


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """QUEST scores of the candidate blocks of a decode batch, from one layer's bounds.

    Args:
        q: ``[S, Hq, D]``, one decode query per sequence, float16/bfloat16/float32, ``D <= 256``.
        kmin, kmax: ``[num_slots, P, Hkv, D]`` (q's dtype), the element-wise key bounds of ``P``
            pages of every block, indexed by metadata slot; head_dim contiguous; Hq % Hkv == 0.
        slots: int64 ``[S, M]``: the slot of each candidate block of each sequence, -1 for none.

    Returns:
        float32 ``[S, M]``: max over the block's pages and over query heads of ``kmax . max(q, 0) +
        kmin . min(q, 0)``; -inf where ``slots`` is -1. Equal to :func:`quest_scores_ref` up to
        float summation order (products of half-precision values are exact in fp32).

    Raises:
        ValueError: shapes or dtypes that disagree, Hq not a multiple of Hkv, D outside 1..256.

    CUDA: one launch over ``S * M * Hkv`` programs and a max over the KV heads. CPU (or float64):
    :func:`quest_scores_ref`.
    """
    _check_args(q, kmin, kmax, slots)
    if q.dtype == torch.float64 or not use_triton(q):
        return quest_scores_ref(q, kmin, kmax, slots)
    seqs, heads_q, dim = q.shape
    num_blocks, (_, num_pages, heads_kv, _) = slots.shape[1], kmin.shape
    if seqs * num_blocks == 0:
        return torch.empty(seqs, num_blocks, dtype=torch.float32, device=q.device)
    partial = torch.empty(seqs, num_blocks, heads_kv, dtype=torch.float32, device=q.device)
    if kmin.stride(-1) != 1 or kmax.stride() != kmin.stride() or q.stride(-1) != 1 or not slots.is_contiguous():
        q, kmin, kmax, slots = q.contiguous(), kmin.contiguous(), kmax.contiguous(), slots.contiguous()
    group = heads_q // heads_kv
    _quest_scores_kernel[(seqs * num_blocks, heads_kv)](
        q, kmin, kmax, slots, partial, num_blocks, num_pages,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), slots.stride(0),
        partial.stride(0), partial.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(MIN_DOT_ROWS, next_pow2(group)), BLOCK_D=block_dim(dim),
        BLOCK_P=_BLOCK_P, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=_NUM_WARPS,
    )
    return partial.amax(2)
