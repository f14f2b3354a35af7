"""XAttention block selection (Xu et al., "XAttention: Block Sparse Attention with Antidiagonal
Scoring", 2025): from the block scores of :func:`nanovllm.ops.xattn_estimate.xattn_block_scores`,
per (head, query block) the smallest set of key blocks whose cumulative score reaches the
threshold, plus the sink and diagonal blocks; the block geometry (:func:`block_layout`) and the
density of a mask (:func:`block_density`). Positions as in :mod:`nanovllm.ops.xattn_estimate`
(queries are the last ``Sq`` of the ``Sk`` keys).
"""

import operator
import struct
from numbers import Real

import torch

from nanovllm.utils.ints import cdiv

from ._triton import check_causal, row_tile
from .backend import interpreted, tl, triton, use_triton


def _as_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= minimum (numpy and 0-d torch integers included); ValueError for a
    bool, float or anything else."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def _lengths(n_q: int, n_k: int, block_size, seq_q, seq_k) -> tuple[int, int, int]:
    """``(block_size, seq_q, seq_k)`` as ints, the lengths defaulting to whole blocks; ValueError
    for a block size < 1, negative or non-integer lengths, or lengths that do not give n_q and
    n_k blocks."""
    block_size = _as_int("block_size", block_size, 1)
    seq_q = n_q * block_size if seq_q is None else _as_int("seq_q", seq_q, 0)
    seq_k = n_k * block_size if seq_k is None else _as_int("seq_k", seq_k, 0)
    if cdiv(seq_q, block_size) != n_q or cdiv(seq_k, block_size) != n_k:
        raise ValueError(
            f"seq_q={seq_q}, seq_k={seq_k} do not give n_q={n_q}, n_k={n_k} blocks of {block_size}"
        )
    return block_size, seq_q, seq_k


def _check_select_args(scores: torch.Tensor, threshold, causal) -> tuple[float, bool]:
    """ValueError for scores that are not a 3-D tensor, a threshold that is not a real number in
    0..1, or a non-bool causal; returns the threshold as a float and causal as a bool."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"expected scores [Hq, nQ, nK]; got {got}")
    if isinstance(threshold, (bool, str)) or not isinstance(threshold, Real) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold={threshold!r} must be a real number in 0..1")
    return float(threshold), check_causal(causal)


def block_layout(
    n_q: int, n_k: int, causal: bool, block_size: int = 128, seq_q: int | None = None,
    seq_k: int | None = None, device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(visible, forced)``, bool ``[n_q, n_k]`` each, for blocks of ``block_size`` tokens.

    ``visible[qb, kb]``: some query of block qb may see some key of block kb: always when not
    causal, else ``kb * block_size <= Sk - Sq + last row of qb``. ``forced``: visible blocks kept
    regardless of score: the sink block 0 and the diagonal blocks (the key blocks holding the
    positions ``Sk - Sq + row`` of qb's own rows), so every query that sees a key keeps itself.
    ``seq_q``/``seq_k`` default to ``n_q * block_size`` / ``n_k * block_size``; pass the real
    lengths when they are not block multiples and ``Sk - Sq`` is not a block multiple.
    """
    block_size, seq_q, seq_k = _lengths(n_q, n_k, block_size, seq_q, seq_k)
    causal = check_causal(causal)
    qb = torch.arange(n_q, device=device)
    kb_start = torch.arange(n_k, device=device) * block_size
    first_pos = seq_k - seq_q + qb * block_size
    last_pos = seq_k - seq_q + torch.clamp((qb + 1) * block_size, max=seq_q) - 1
    if causal:
        visible = kb_start[None, :] <= last_pos[:, None]
    else:
        visible = torch.ones((n_q, n_k), dtype=torch.bool, device=device)
    diagonal = (kb_start[None, :] + block_size - 1 >= first_pos[:, None]) & (kb_start[None, :] <= last_pos[:, None])
    sink = (torch.arange(n_k, device=device) == 0)[None, :]
    return visible, visible & (diagonal | sink)


def xattn_select_blocks_ref(
    scores: torch.Tensor,
    threshold: float,
    causal: bool = True,
    block_size: int = 128,
    seq_q: int | None = None,
    seq_k: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`xattn_select_blocks` (same arguments, result and errors): a stable
    float64 sort per row, a cumulative sum and a scatter back."""
    threshold, causal = _check_select_args(scores, threshold, causal)
    _, n_q, n_k = scores.shape
    visible, forced = block_layout(n_q, n_k, causal, block_size, seq_q, seq_k, scores.device)
    if threshold >= 1.0:
        return visible.expand(scores.shape).clone()
    values = torch.where(visible, scores.double(), 0.0)
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    before = torch.cumsum(ordered, dim=-1) - ordered
    keep = torch.zeros_like(visible.expand(scores.shape)).scatter(-1, order, before < threshold)
    return (keep & visible) | forced


@triton.jit
def _visible_forced(kb, qb, n_k, offset, seq_q, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr):
    """:func:`block_layout`'s (visible, forced) for key blocks ``kb`` of query block ``qb``."""
    start = kb * BLOCK_SIZE
    first_pos = offset + qb * BLOCK_SIZE
    last_pos = offset + tl.minimum((qb + 1) * BLOCK_SIZE, seq_q) - 1
    visible = kb < n_k
    if CAUSAL:
        visible = visible & (start <= last_pos)
    diagonal = (start + BLOCK_SIZE - 1 >= first_pos) & (start <= last_pos)
    return visible, visible & (diagonal | (kb == 0))


@triton.jit
def _float_order(bits):
    """int32 bits of float32 values -> int32 that orders as the floats do (-0.0 just below +0.0;
    the map is its own inverse): negative floats get their 31 low bits flipped."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["n_q", "n_k", "offset", "seq_q", "threshold_bits", "stride_sh", "stride_sq",
                                "stride_mh", "stride_mq"])
def _select_kernel(
    scores_ptr, mask_ptr, n_q, n_k, offset, seq_q, threshold_bits, stride_sh, stride_sq, stride_mh, stride_mq,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Program (h, qb). key = order(score bits) << log2(BLOCK_K) | (BLOCK_K - 1 - kb) sorts
    descending by score, ties by ascending index (the reference's stable order); hidden and
    padding blocks sort as score 0. ``threshold_bits``: the float64 threshold's bits (a float
    argument would be rounded to float32)."""
    h = tl.program_id(0) // n_q
    qb = tl.program_id(0) % n_q
    kb = tl.arange(0, BLOCK_K)
    scores = tl.load(scores_ptr + h * stride_sh + qb * stride_sq + kb, mask=kb < n_k, other=0.0)
    visible, _ = _visible_forced(kb, qb, n_k, offset, seq_q, BLOCK_SIZE, CAUSAL)
    order = _float_order(tl.where(visible, scores, 0.0).to(tl.int32, bitcast=True))
    key = tl.sort((order.to(tl.int64) << LOG2_BLOCK_K) | (BLOCK_K - 1 - kb), descending=True)
    index = (BLOCK_K - 1 - (key & (BLOCK_K - 1))).to(tl.int32)
    value = _float_order((key >> LOG2_BLOCK_K).to(tl.int32)).to(tl.float32, bitcast=True).to(tl.float64)
    threshold = threshold_bits.to(tl.int64).to(tl.float64, bitcast=True)
    keep = tl.cumsum(value, 0) - value < threshold
    visible, forced = _visible_forced(index, qb, n_k, offset, seq_q, BLOCK_SIZE, CAUSAL)
    tl.store(mask_ptr + h * stride_mh + qb * stride_mq + index, ((keep & visible) | forced).to(tl.uint8),
             mask=index < n_k)


def xattn_select_blocks(
    scores: torch.Tensor,
    threshold: float,
    causal: bool = True,
    block_size: int = 128,
    seq_q: int | None = None,
    seq_k: int | None = None,
) -> torch.Tensor:
    """XAttention threshold selection: bool ``[Hq, nQ, nK]`` mask of the key blocks to compute.

    Per (head, query block), the visible key blocks are ordered by descending score (stable: ties
    keep index order) and block ``n`` in that order is kept while the sum of the scores before it
    is ``< threshold``, i.e. the smallest prefix whose cumulative score reaches ``threshold``
    (cumulated in float64). ``threshold >= 1`` keeps every visible block. The sink block 0 and the
    diagonal blocks are always kept; a causally hidden block never is (see :func:`block_layout`).
    Kept sets grow monotonically with the threshold.

    Args:
        scores: ``[Hq, nQ, nK]`` non-negative block scores, rows summing to 1 (as from
            :func:`xattn_block_scores`); any float dtype.
        threshold: cumulative share to reach, ``0 <= threshold <= 1`` (paper: 0.9-0.95).
        causal: whether the attention is causal (bottom-right aligned).
        block_size, seq_q, seq_k: the token lengths behind the blocks (see :func:`block_layout`).

    Raises:
        ValueError: scores not a 3-D tensor, threshold outside 0..1, causal not a bool,
            block_size not a positive int, or lengths inconsistent with the shape.

    CUDA (float32 scores): one Triton kernel, a program per (head, query block): the row's scores
    packed with their indices into int64 keys, one bitonic sort (``tl.sort``), the float64 prefix
    sum, and the kept flags scattered back; no host sync. Its scan adds in another order than
    torch's cumsum, which can only matter where the threshold lies within float64 rounding of a
    partial sum. Else :func:`xattn_select_blocks_ref`.
    """
    threshold, causal = _check_select_args(scores, threshold, causal)
    heads, n_q, n_k = scores.shape
    if threshold >= 1.0 or scores.dtype != torch.float32 or not use_triton(scores) or scores.numel() == 0:
        return xattn_select_blocks_ref(scores, threshold, causal, block_size, seq_q, seq_k)
    block_size, seq_q, seq_k = _lengths(n_q, n_k, block_size, seq_q, seq_k)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    mask = torch.empty(scores.shape, dtype=torch.uint8, device=scores.device)
    block_k = row_tile(n_k, interpreted(scores))
    threshold_bits = struct.unpack("<q", struct.pack("<d", threshold))[0]
    _select_kernel[(heads * n_q,)](
        scores, mask, n_q, n_k, seq_k - seq_q, seq_q, threshold_bits, scores.stride(0), scores.stride(1),
        mask.stride(0), mask.stride(1),
        BLOCK_SIZE=block_size, BLOCK_K=block_k, LOG2_BLOCK_K=block_k.bit_length() - 1, CAUSAL=causal,
        num_warps=min(16, max(4, block_k // 256)),
    )
    return mask.view(torch.bool)


def block_density(
    mask: torch.Tensor, causal: bool = True, block_size: int = 128, seq_q: int | None = None,
    seq_k: int | None = None,
) -> float:
    """Kept blocks / visible blocks of a ``[Hq, nQ, nK]`` bool mask (0.0 when nothing is visible);
    visibility as in :func:`block_layout`. Syncs with the device (returns a Python float)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"expected mask [Hq, nQ, nK]; got {got}")
    heads, n_q, n_k = mask.shape
    visible, _ = block_layout(n_q, n_k, causal, block_size, seq_q, seq_k, mask.device)
    total = int(visible.sum()) * heads
    return float((mask.bool() & visible).sum()) / total if total else 0.0
