"""XAttention estimation over keys that arrive in pieces, and over bounded query chunks.

:func:`nanovllm.ops.xattn_estimate.xattn_block_scores` (Xu et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025) needs every key at once: its softmax runs over a
strided query row's whole key range. Split into two passes over the keys, it does not:

1. :func:`xattn_row_stats` gives, per strided query row, the max and the sum of exp of the
   strided scores over one piece of the keys; :func:`merge_row_stats` combines pieces exactly
   (FlashAttention-2's online-softmax rescaling);
2. :func:`xattn_block_sums`, given the statistics of *all* keys, sums one piece's normalised
   probabilities into blocks. The pieces' block sums, concatenated along the key blocks and
   row-normalised (:func:`nanovllm.ops.xattn_estimate.normalise_block_rows`), are the block scores
   of the whole key range.

Offload mode streams the earlier KV blocks (keys only) through the GPU ring buffer twice, once
per pass. GPU-only prefill bounds its memory by estimating ``chunk_size`` query rows at a time
(:func:`xattn_block_mask`). Piece boundaries must be multiples of ``stride`` (key pieces) and of
``block_size`` (query chunks, and key pieces whose block sums are concatenated).

``offset`` is the key position of query row 0 (default ``Sk - Sq``: the queries are the last
``Sq`` of the ``Sk`` keys, bottom-right aligned); it only matters when ``causal``.
"""

import torch

from ._triton import LN2, LOG2E, cdiv, use_triton
from .xattn_estimate import (
    _check_estimate_args,
    _check_qk,
    _launch_block_sums,
    _launch_row_stats,
    _strided_layout,
    query_offset,
    xattn_block_scores,
)
from .xattn_select import xattn_select_blocks


def _check_stats(q: torch.Tensor, stride: int, row_max: torch.Tensor, row_sumexp: torch.Tensor) -> None:
    shape = (q.shape[1], cdiv(q.shape[0], stride))
    if tuple(row_max.shape) != shape or tuple(row_sumexp.shape) != shape:
        raise ValueError(f"row_max and row_sumexp must be [Hq, ceil(Sq/stride)] = {shape}; got "
                         f"{tuple(row_max.shape)} and {tuple(row_sumexp.shape)}")


def _head_scores(q_str, k_str, visible, h, group, scale, stride):
    scores = (q_str[h] @ k_str[h // group].T) * (scale / stride)
    return scores.masked_fill(~visible, float("-inf"))


def xattn_row_stats_ref(
    q: torch.Tensor, k: torch.Tensor, stride: int = 8, scale: float | None = None, causal: bool = True,
    offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`xattn_row_stats` (same arguments and results); one head's
    ``[Sq/stride, Sk/stride]`` strided scores at a time, in float32 (float64 inputs: float64)."""
    stride = _check_qk(q, k, stride)
    heads_q, heads_kv = q.shape[1], k.shape[1]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    n_qs = cdiv(q.shape[0], stride)
    row_max = torch.full((heads_q, n_qs), float("-inf"), dtype=torch.float32, device=q.device)
    row_sumexp = torch.zeros((heads_q, n_qs), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return row_max, row_sumexp
    q_str, k_str, visible = _strided_layout(q, k, stride, causal, query_offset(q, k, offset))
    for h in range(heads_q):
        scores = _head_scores(q_str, k_str, visible, h, heads_q // heads_kv, scale, stride)
        top = scores.amax(-1)
        safe = torch.where(torch.isneginf(top), 0.0, top)
        row_max[h] = top.float()
        row_sumexp[h] = torch.exp(scores - safe[:, None]).sum(-1).float()
    return row_max, row_sumexp


def xattn_row_stats(
    q: torch.Tensor, k: torch.Tensor, stride: int = 8, scale: float | None = None, causal: bool = True,
    offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of XAttention's estimation over one piece of the keys: softmax statistics of the
    strided scores, per strided query row.

    With ``A[r, j]`` the strided scores of :func:`nanovllm.ops.xattn_estimate.xattn_block_scores`
    (steps 1-2; causal visibility ``j*S <= offset + r*S + S - 1``):
    ``row_max[h, r] = max_j A[r, j]`` and ``row_sumexp[h, r] = sum_j exp(A[r, j] - row_max[h, r])``
    over the visible strided keys ``j`` of ``k``.

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hkv, D]`` (one piece of the keys); ``Hq % Hkv == 0``,
            ``1 <= D <= 256``; float16/bfloat16/float32 (float64 goes to the reference).
        stride: S, a power of two in 1..64. scale: softmax scale of the real attention (default
            ``D ** -0.5``). causal, offset: see the module docstring.

    Returns:
        ``(row_max, row_sumexp)``, float32 ``[Hq, ceil(Sq / S)]`` each, in natural-log units; a
        row that sees no key of this piece has ``-inf`` and ``0``.

    Raises:
        ValueError: q/k not 3-D or differing in D, Hq not a multiple of Hkv, D outside 1..256, or
            stride not a power of two in 1..64.

    CUDA: a Triton kernel, the strided GEMM with online-softmax statistics (no reshape copy). CPU:
    the reference.
    """
    stride = _check_qk(q, k, stride)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if q.dtype == torch.float64 or not use_triton(q) or q.shape[0] == 0 or k.shape[0] == 0:
        return xattn_row_stats_ref(q, k, stride, scale, causal, offset)
    m_log2, row_sumexp = _launch_row_stats(q, k, stride, stride, scale, causal, query_offset(q, k, offset))
    return m_log2 * LN2, row_sumexp


def merge_row_stats(
    max_a: torch.Tensor, sumexp_a: torch.Tensor, max_b: torch.Tensor, sumexp_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics over the union of two disjoint key pieces: ``m = max(max_a, max_b)``,
    ``sumexp = sumexp_a * exp(max_a - m) + sumexp_b * exp(max_b - m)``. Any matching shapes;
    a side with max ``-inf`` contributes nothing (both: ``-inf``, 0)."""
    top = torch.maximum(max_a, max_b)
    safe = torch.where(torch.isneginf(top), 0.0, top)
    return top, sumexp_a * torch.exp(max_a - safe) + sumexp_b * torch.exp(max_b - safe)


def xattn_block_sums_ref(
    q: torch.Tensor, k: torch.Tensor, row_max: torch.Tensor, row_sumexp: torch.Tensor, stride: int = 8,
    block_size: int = 128, scale: float | None = None, causal: bool = True, offset: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`xattn_block_sums` (same arguments and result)."""
    stride, block_size = _check_estimate_args(q, k, stride, block_size)
    _check_stats(q, stride, row_max, row_sumexp)
    heads_q, heads_kv = q.shape[1], k.shape[1]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    tile = block_size // stride
    n_q, n_k = cdiv(q.shape[0], block_size), cdiv(k.shape[0], block_size)
    out = torch.zeros((heads_q, n_q, n_k), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return out
    q_str, k_str, visible = _strided_layout(q, k, stride, causal, query_offset(q, k, offset))
    n_qs, n_ks = visible.shape
    seen = row_sumexp > 0
    safe_max = torch.where(seen, row_max, 0.0).to(q_str.dtype)
    inv_sum = torch.where(seen, 1.0 / torch.where(seen, row_sumexp, 1.0), 0.0).to(q_str.dtype)
    for h in range(heads_q):
        scores = _head_scores(q_str, k_str, visible, h, heads_q // heads_kv, scale, stride)
        probs = torch.exp(scores - safe_max[h, :, None]) * inv_sum[h, :, None]
        padded = torch.zeros((n_q * tile, n_k * tile), dtype=q_str.dtype, device=q.device)
        padded[:n_qs, :n_ks] = probs
        out[h] = padded.view(n_q, tile, n_k, tile).sum(dim=(1, 3)).float()
    return out


def xattn_block_sums(
    q: torch.Tensor, k: torch.Tensor, row_max: torch.Tensor, row_sumexp: torch.Tensor, stride: int = 8,
    block_size: int = 128, scale: float | None = None, causal: bool = True, offset: int | None = None,
) -> torch.Tensor:
    """Pass 2 of XAttention's estimation over one piece of the keys: the strided probabilities
    ``exp(A[r, j] - row_max[h, r]) / row_sumexp[h, r]`` summed per ``block_size`` x
    ``block_size`` block (steps 3-4 of :func:`nanovllm.ops.xattn_estimate.xattn_block_scores`
    with the softmax denominator given), rows *not* normalised.

    Args:
        q, k, stride, scale, causal, offset: as in :func:`xattn_row_stats`.
        row_max, row_sumexp: float32 ``[Hq, ceil(Sq / S)]``, statistics over *all* keys (pieces
            combined with :func:`merge_row_stats`); rows with ``row_sumexp == 0`` give 0.
        block_size: a power of two in ``stride..1024``; key block ``c`` of the result is keys
            ``c*block_size ..`` of this piece.

    Returns:
        float32 ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]``; causally hidden blocks 0.

    Raises:
        ValueError: as :func:`xattn_row_stats`, a bad block_size, or statistics of another shape.

    CUDA: a Triton kernel recomputing the strided GEMM, normalising it by the given statistics and
    summing blocks. CPU: the reference.
    """
    stride, block_size = _check_estimate_args(q, k, stride, block_size)
    _check_stats(q, stride, row_max, row_sumexp)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if q.dtype == torch.float64 or not use_triton(q):
        return xattn_block_sums_ref(q, k, row_max, row_sumexp, stride, block_size, scale, causal, offset)
    m_log2 = torch.where(row_sumexp > 0, row_max.float() * LOG2E, float("-inf"))
    return _launch_block_sums(q, k, m_log2, row_sumexp.float(), stride, block_size, scale, causal,
                              query_offset(q, k, offset))


def xattn_block_mask(
    q: torch.Tensor, k: torch.Tensor, threshold: float, stride: int = 8, block_size: int = 128,
    scale: float | None = None, chunk_size: int = 16384,
) -> torch.Tensor:
    """Causal XAttention block mask of q (the last ``Sq`` of the ``Sk`` keys), estimated and
    selected ``chunk_size`` query rows at a time.

    Equals ``xattn_select_blocks(xattn_block_scores(q, k, stride, block_size, scale),
    threshold, True, block_size, Sq, Sk)``, but a chunk only holds the statistics and block sums
    of its own rows against the keys it can see, so memory is bounded by ``chunk_size`` rows
    (the torch reference materialises ``chunk_size/S x Sk/S`` strided scores per head). Each
    chunk is one :func:`~nanovllm.ops.xattn_estimate.xattn_block_scores` call (one pass over its
    strided GEMM on CUDA) with the chunk's own ``offset``.

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hkv, D]`` with ``Sk >= Sq``; as in :func:`xattn_row_stats`.
        threshold: cumulative share to keep per query block, ``0 <= threshold <= 1``.
        stride, block_size, scale: as in :func:`xattn_block_sums`.
        chunk_size: query rows per estimation call, a positive multiple of ``block_size``.

    Returns:
        bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]`` on q's device.

    Raises:
        ValueError: bad shapes, stride, block_size or threshold, ``Sk < Sq``, or a chunk_size that
            is not a positive multiple of block_size.
    """
    stride, block_size = _check_estimate_args(q, k, stride, block_size)
    seq_q, seq_k = q.shape[0], k.shape[0]
    if seq_k < seq_q:
        raise ValueError(f"causal prefill needs Sk >= Sq; got Sq={seq_q}, Sk={seq_k}")
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold={threshold} is outside 0..1")
    if not isinstance(chunk_size, int) or chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of block_size={block_size}")
    offset = seq_k - seq_q
    mask = torch.zeros((q.shape[1], cdiv(seq_q, block_size), cdiv(seq_k, block_size)), dtype=torch.bool,
                       device=q.device)
    for r0 in range(0, seq_q, chunk_size):
        r1 = min(r0 + chunk_size, seq_q)
        end = offset + r1  # keys the chunk's rows may see, up to its last strided key
        keys = k[:min(seq_k, cdiv(end, stride) * stride)]
        n_k = cdiv(end, block_size)
        scores = xattn_block_scores(q[r0:r1], keys, stride, block_size, scale, True, offset + r0)[:, :, :n_k]
        mask[:, r0 // block_size:cdiv(r1, block_size), :n_k] = xattn_select_blocks(
            scores, threshold, True, block_size, r1 - r0, end)
    return mask
