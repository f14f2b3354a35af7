"""QUEST's page scores for decode queries, chosen per KV head (Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

For a page of keys with element-wise bounds ``kmin``, ``kmax`` (``[D]`` per KV head) and a query
``q``, ``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` over every key of
the page; it equals ``kmax . max(q, 0) + kmin . min(q, 0)`` (:func:`page_bounds`). Quest keeps a
page per head; with grouped-query attention the query heads of a KV head read the same pages, so
a KV head chooses for its group (:func:`top_pages`): each query head's bounds (times the softmax
scale) become a softmax over the candidate pages, that head's estimate of how its attention
divides among them, and the group combines its heads' shares (the largest, or their sum), so
that no head whose bounds are large everywhere decides for the others.
"""
import torch

from nanovllm.utils.ints import cdiv

from ._triton import LOG2E, MIN_DOT_ROWS, block_dim, check_gqa, check_head_dim, next_pow2, row_tile
from .backend import interpreted, tl, triton, use_triton

_BLOCK_P = 64
"""Candidate pages per program of :func:`page_bounds`."""
_NUM_WARPS = 4
COMBINES = ("max", "sum")
"""How a KV head combines its query heads' shares of a page (:func:`top_pages`)."""


def _check_bounds_args(q, kmin, kmax, pages) -> None:
    if q.dim() != 3 or kmin.dim() != 3 or kmin.shape != kmax.shape or q.shape[2] != kmin.shape[2]:
        raise ValueError(f"expected q [S, Hq, D] and kmin, kmax [num_pages, Hkv, D] with one D; got q "
                         f"{tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")
    check_gqa(q.shape[1], kmin.shape[1])
    check_head_dim(q.shape[2])
    if kmin.dtype != kmax.dtype:
        raise ValueError(f"kmin and kmax must share a dtype; got {kmin.dtype} and {kmax.dtype}")
    if pages.dim() != 2 or pages.shape[0] != q.shape[0] or pages.dtype != torch.int64:
        raise ValueError(f"pages must be int64 [S={q.shape[0]}, C]; got {pages.dtype} {tuple(pages.shape)}")


def page_bounds_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`page_bounds` (same arguments and result), in float32 (float64 for
    float64 q)."""
    _check_bounds_args(q, kmin, kmax, pages)
    seqs, heads_q, dim = q.shape
    heads_kv = kmin.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dtype).view(seqs, heads_kv, heads_q // heads_kv, dim)
    index = pages.clamp(min=0)
    upper = torch.einsum("schd,shgd->schg", kmax[index].to(dtype), qg.clamp(min=0))
    upper += torch.einsum("schd,shgd->schg", kmin[index].to(dtype), qg.clamp(max=0))
    return upper.flatten(2).masked_fill((pages < 0)[..., None], float("-inf")).to(torch.float32)


@triton.jit(do_not_specialize=["num_pages", "stride_ps", "stride_os"])  # one variant whatever the batch
def _page_bounds_kernel(
    q_ptr, kmin_ptr, kmax_ptr, pages_ptr, out_ptr, num_pages, upper_weight, lower_weight,
    stride_qs, stride_qh, stride_bp, stride_bh, stride_ps, stride_os, stride_oc,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr, LOWER: tl.constexpr,
):
    """Program (sequence, tile of BLOCK_P candidates, KV head): the scores of its GQA group, the
    upper bound (LOWER False) or ``upper_weight * upper + lower_weight * lower`` (LOWER True)."""
    seq = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    kv_head = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask, d_mask, c_mask = g < GROUP, d < HEAD_DIM, c < num_pages
    q = tl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.maximum(q, 0.0).to(kmax_ptr.dtype.element_ty)  # exact in q's dtype
    q_neg = tl.minimum(q, 0.0).to(kmax_ptr.dtype.element_ty)
    page = tl.load(pages_ptr + seq * stride_ps + c, mask=c_mask, other=-1)
    valid = page >= 0
    offsets = tl.maximum(page, 0).to(tl.int64)[:, None] * stride_bp + kv_head * stride_bh + d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    kmax = tl.load(kmax_ptr + offsets, mask=mask, other=0.0)
    kmin = tl.load(kmin_ptr + offsets, mask=mask, other=0.0)
    score = tl.dot(q_pos, tl.trans(kmax), input_precision=DOT_PRECISION)
    score = tl.dot(q_neg, tl.trans(kmin), score, input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_P]
    if LOWER:  # the box's lower bound from the same tiles, combined in fp32
        lower = tl.dot(q_pos, tl.trans(kmin), input_precision=DOT_PRECISION)
        lower = tl.dot(q_neg, tl.trans(kmax), lower, input_precision=DOT_PRECISION)
        score = score * upper_weight + lower * lower_weight
    score = tl.where(valid[None, :], score, float("-inf"))
    out = out_ptr + seq * stride_os + c[None, :] * stride_oc + (kv_head * GROUP + g)[:, None]
    tl.store(out, score, mask=g_mask[:, None] & c_mask[None, :])


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """QUEST's upper bounds of ``q . k`` over the keys of each candidate page, per query head.

    Args:
        q: ``[S, Hq, D]``, one decode query per sequence, float16/bfloat16/float32, ``D <= 256``.
        kmin, kmax: ``[num_pages, Hkv, D]`` (q's dtype), the element-wise key bounds of every page
            of one layer, indexed by page id; head_dim contiguous; ``Hq % Hkv == 0``.
        pages: int64 ``[S, C]``: the page id of each candidate of each sequence, -1 for none.

    Returns:
        float32 ``[S, C, Hq]``: ``kmax . max(q, 0) + kmin . min(q, 0)`` with query head ``h``
        reading KV head ``h // (Hq // Hkv)``'s bounds; -inf where ``pages`` is -1. Equal to
        :func:`page_bounds_ref` up to float summation order (products of half-precision values
        are exact in fp32).

    Raises:
        ValueError: shapes or dtypes that disagree, Hq not a multiple of Hkv, D outside 1..256.

    CUDA: one Triton launch over ``S x ceil(C / 64) x Hkv`` programs, two ``tl.dot`` each with
    fp32 accumulation (the GQA group padded to 16 rows). CPU (or float64): :func:`page_bounds_ref`.
    """
    _check_bounds_args(q, kmin, kmax, pages)
    if q.dtype == torch.float64 or not use_triton(q):
        return page_bounds_ref(q, kmin, kmax, pages)
    return _launch(q, kmin, kmax, pages, None)


def _launch(q, kmin, kmax, pages, weights: tuple[float, float] | None) -> torch.Tensor:
    """One launch of :func:`_page_bounds_kernel`: the upper bounds, or with ``weights`` ``(upper
    weight, lower weight)`` their combination with the lower bounds (checked arguments)."""
    seqs, heads_q, dim = q.shape
    num_pages, heads_kv = pages.shape[1], kmin.shape[1]
    bounds = torch.empty(seqs, num_pages, heads_q, dtype=torch.float32, device=q.device)
    if seqs * num_pages == 0:
        return bounds
    if kmin.stride(-1) != 1 or kmax.stride() != kmin.stride() or q.stride(-1) != 1 or not pages.is_contiguous():
        q, kmin, kmax, pages = q.contiguous(), kmin.contiguous(), kmax.contiguous(), pages.contiguous()
    group = heads_q // heads_kv
    upper_weight, lower_weight = weights or (1.0, 0.0)
    _page_bounds_kernel[(seqs, cdiv(num_pages, _BLOCK_P), heads_kv)](
        q, kmin, kmax, pages, bounds, num_pages, upper_weight, lower_weight,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), pages.stride(0), bounds.stride(0), bounds.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(MIN_DOT_ROWS, next_pow2(group)), BLOCK_D=block_dim(dim),
        BLOCK_P=_BLOCK_P, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=_NUM_WARPS,
        LOWER=weights is not None,
    )
    return bounds


def box_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
               radius_weight: float) -> torch.Tensor:
    """Each candidate page's score of ``q`` over the box of its keys, per query head:
    ``q . c + radius_weight * |q| . r`` with the box's center ``c = (kmin + kmax) / 2`` and radius
    ``r = (kmax - kmin) / 2``. ``radius_weight`` 1.0 is QUEST's upper bound (:func:`page_bounds`),
    0.0 the center's score; in between, a bound shrunk towards the center (the bound counts every
    dimension's extreme, which no single key of the page reaches at once).

    Args: as :func:`page_bounds`; radius_weight in [0, 1].

    Returns:
        float32 ``[S, C, Hq]``, -inf where ``pages`` is -1.

    Raises:
        ValueError: as :func:`page_bounds`, or radius_weight outside [0, 1].

    The score is ``(1 + w) / 2 * upper + (1 - w) / 2 * lower`` with the box's upper and lower
    bounds of ``q . k`` (the lower is :func:`page_bounds` with kmin and kmax swapped). CUDA: one
    launch of :func:`page_bounds`'s kernel, which reads each page's bounds once and combines the
    two in fp32 (four ``tl.dot``; two when ``w`` is 1). CPU (or float64): :func:`box_scores_ref`.
    """
    weights = _box_weights(radius_weight)
    _check_bounds_args(q, kmin, kmax, pages)
    if q.dtype == torch.float64 or not use_triton(q):
        return box_scores_ref(q, kmin, kmax, pages, radius_weight)
    return _launch(q, kmin, kmax, pages, weights)


def box_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                   radius_weight: float) -> torch.Tensor:
    """Reference of :func:`box_scores` (same arguments and result): the upper and lower bounds by
    :func:`page_bounds_ref`, combined in float32 (float64 for float64 q)."""
    weights = _box_weights(radius_weight)
    upper = page_bounds_ref(q, kmin, kmax, pages)
    if weights is None:
        return upper
    return upper * weights[0] + page_bounds_ref(q, kmax, kmin, pages) * weights[1]


def _box_weights(radius_weight: float) -> tuple[float, float] | None:
    """``((1 + w) / 2, (1 - w) / 2)``, the weights of the upper and lower bounds in a box score, or
    None for ``w`` = 1 (the upper bound alone).

    Raises:
        ValueError: radius_weight outside [0, 1].
    """
    if not 0.0 <= radius_weight <= 1.0:
        raise ValueError(f"radius_weight must be in [0, 1], got {radius_weight!r}")
    return None if radius_weight == 1.0 else ((1.0 + radius_weight) / 2, (1.0 - radius_weight) / 2)


def page_scores_ref(bounds: torch.Tensor, scale: float, heads_kv: int, combine: str) -> torch.Tensor:
    """Reference of :func:`page_scores` (same arguments and result), in torch."""
    _check_scores_args(bounds, heads_kv, combine)
    seqs, num_pages, heads_q = bounds.shape
    # heads first, candidates contiguous: the softmax runs along the last dimension (over a middle
    # one, CUDA's softmax runs a strided kernel many times slower)
    logits = bounds.transpose(1, 2).clone(memory_format=torch.contiguous_format).mul_(scale)  # bounds untouched
    shares = torch.softmax(logits, dim=2).nan_to_num_(0.0)  # a row without candidates: 0/0
    grouped = shares.view(seqs, heads_kv, heads_q // heads_kv, num_pages)
    score = grouped.amax(2) if combine == "max" else grouped.sum(2)
    return score.masked_fill_(torch.isneginf(bounds[..., 0])[:, None, :], float("-inf"))


def _check_scores_args(bounds: torch.Tensor, heads_kv: int, combine: str) -> None:
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if bounds.dim() != 3 or bounds.dtype != torch.float32:
        raise ValueError(f"bounds must be float32 [S, C, Hq]; got {bounds.dtype} {tuple(bounds.shape)}")
    check_gqa(bounds.shape[2], heads_kv)


@triton.jit(do_not_specialize=["num_pages", "stride_bs", "stride_os"])  # one variant whatever the context
def _page_scores_kernel(bounds_ptr, out_ptr, num_pages, scale_log2, stride_bs, stride_bc, stride_os,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, SUM: tl.constexpr):
    """Program (sequence, KV head): per query head of its group the softmax over the candidates of
    ``scale * bounds`` (an online max and sum, base 2, in one pass), then the group's shares
    combined (sum or max) in a second pass; -inf where a page is not a candidate."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_C)
    row = bounds_ptr + seq * stride_bs + (kv_head * GROUP + g)[None, :]
    g_mask = (g < GROUP)[None, :]
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    for start in range(0, num_pages, BLOCK_C):
        c = start + cols
        x = tl.load(row + c[:, None] * stride_bc, mask=(c < num_pages)[:, None] & g_mask, other=float("-inf"))
        x = x * scale_log2
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no candidate yet: nothing to rescale
        total = total * tl.exp2(m - safe) + tl.sum(tl.exp2(x - safe[None, :]), axis=0)
        m = m_new
    safe = tl.where(m == float("-inf"), 0.0, m)
    inv = tl.where(total > 0, 1.0 / total, 0.0)  # a head without candidates: shares 0
    out = out_ptr + seq * stride_os + kv_head * num_pages
    for start in range(0, num_pages, BLOCK_C):
        c = start + cols
        x = tl.load(row + c[:, None] * stride_bc, mask=(c < num_pages)[:, None] & g_mask, other=float("-inf"))
        shares = tl.exp2(x * scale_log2 - safe[None, :]) * inv[None, :]
        shares = tl.where(g_mask, shares, 0.0)
        score = tl.sum(shares, axis=1) if SUM else tl.max(shares, axis=1)
        first = tl.max(tl.where(g[None, :] == 0, x, float("-inf")), axis=1)  # the group's first head
        tl.store(out + c, tl.where(first == float("-inf"), float("-inf"), score), mask=c < num_pages)


_SCORES_TILE = 8192
"""Bounds per tile of :func:`_page_scores_kernel` (candidates times the GQA group, padded)."""


def page_scores(bounds: torch.Tensor, scale: float, heads_kv: int, combine: str) -> torch.Tensor:
    """One score per (KV head, candidate page) from its query heads' bounds (module docstring).

    Args:
        bounds: float32 ``[S, C, Hq]`` from :func:`page_bounds`, -inf for pages that are not
            candidates (for every head).
        scale: the attention's softmax scale.
        heads_kv: KV heads; query head ``h`` belongs to KV head ``h // (Hq // heads_kv)``.
        combine: "max" or "sum" of the group's shares.

    Returns:
        float32 ``[S, Hkv, C]``: per query head ``softmax`` over the candidates of ``scale *
        bounds``, combined over the GQA group; -inf where a page is not a candidate. ``bounds``
        is not modified.

    Raises:
        ValueError: ``combine`` not one of :data:`COMBINES`, bounds not float32 ``[S, C, Hq]``,
            Hq not a multiple of heads_kv.

    CUDA: one Triton launch, a program per (sequence, KV head) (online softmax over the
    candidates, then the combination). CPU: :func:`page_scores_ref`.
    """
    _check_scores_args(bounds, heads_kv, combine)
    if not use_triton(bounds):
        return page_scores_ref(bounds, scale, heads_kv, combine)
    seqs, num_pages, heads_q = bounds.shape
    out = torch.empty(seqs, heads_kv, num_pages, dtype=torch.float32, device=bounds.device)
    if out.numel():
        if bounds.stride(2) != 1:
            bounds = bounds.contiguous()
        group = heads_q // heads_kv
        _page_scores_kernel[(seqs, heads_kv)](
            bounds, out, num_pages, scale * LOG2E, bounds.stride(0), bounds.stride(1), out.stride(0),
            GROUP=group, BLOCK_G=next_pow2(group), BLOCK_C=max(16, _SCORES_TILE // next_pow2(group)),
            SUM=combine == "sum", num_warps=8)
    return out


def top_pages_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Reference of :func:`top_pages` (same arguments and result, up to which of equal scores at the
    k-th place are taken and where the -1 picks stand): ``torch.topk``, the columns then in
    ascending order as the kernel writes them (the order does not depend on the padding)."""
    _check_top_pages_args(scores, k)
    values, columns = scores.topk(min(k, scores.shape[2]), dim=2, sorted=False)
    return columns.masked_fill(values == float("-inf"), -1).sort(dim=2).values


def _check_top_pages_args(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [S, Hkv, C]; got {scores.dtype} {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


@triton.jit(do_not_specialize=["num_cols", "k"])  # one variant whatever the context and budget
def _top_pages_kernel(scores_ptr, out_ptr, num_cols, k, BLOCK: tl.constexpr):
    """Program (row of ``[rows, num_cols]`` float32 scores): the columns of its ``k`` largest,
    in column order, into ``out [rows, k]`` (-1 where the score is -inf). Scores become int32 keys
    of the same order (a negative float's magnitude bits flipped); the k-th largest key is found
    bit by bit (32 counting passes over the row), a pass counts the keys above it, and a last
    pass writes the columns above it and the first columns equal to it (prefix sums place them)."""
    row = tl.program_id(0).to(tl.int64)
    scores_ptr += row * num_cols
    out_ptr += row * k
    cols = tl.arange(0, BLOCK)
    lo = tl.full((), -2147483648, tl.int64)  # the k-th largest key lies in [lo, hi]: count(key >= lo) >= k
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = 0
        for start in range(0, num_cols, BLOCK):
            c = start + cols
            bits = tl.load(scores_ptr + c, mask=c < num_cols, other=0.0).to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            count += tl.sum(((key >= mid) & (c < num_cols)).to(tl.int32), axis=0)
        if count >= k:
            lo = mid
        else:
            hi = mid - 1
    above = 0  # columns whose key is above the k-th largest: all taken; ties taken in column order
    for start in range(0, num_cols, BLOCK):
        c = start + cols
        bits = tl.load(scores_ptr + c, mask=c < num_cols, other=0.0).to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        above += tl.sum(((key > lo) & (c < num_cols)).to(tl.int32), axis=0)
    ties_left = k - above
    written = 0
    for start in range(0, num_cols, BLOCK):
        c = start + cols
        in_row = c < num_cols
        value = tl.load(scores_ptr + c, mask=in_row, other=0.0)
        bits = value.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        tie = ((key == lo) & in_row).to(tl.int32)
        take = ((key > lo) & in_row) | ((tie != 0) & (tl.cumsum(tie, axis=0) <= ties_left))
        place = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        column = tl.where(value == float("-inf"), -1, c.to(tl.int64))
        tl.store(out_ptr + place, column, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_left -= tl.sum(tie, axis=0)


_TOP_MAX_TILE = 8192
"""Most columns per tile of :func:`_top_pages_kernel`: a row of up to this many candidates is one
tile, which each of its 34 passes reads again (from L1 or L2)."""


def top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per (sequence, KV head) of ``scores`` ``[S, Hkv, C]`` (-inf: not a candidate), the columns
    of its ``k`` best candidates.

    Args:
        scores: float32 ``[S, Hkv, C]``.
        k: picks per row, >= 1.

    Returns:
        int64 ``[S, Hkv, min(k, C)]``: the columns, in no particular order (a head's reads are
        summed in any order), -1 for the picks of a head with fewer candidates. No host sync.

    Raises:
        ValueError: scores not float32 ``[S, Hkv, C]``, or k < 1.

    CUDA: one Triton launch, a program per row (a radix select of the k-th largest score, then a
    compaction; the columns come in ascending order, equal scores at the k-th place taken from
    the left). CPU: :func:`top_pages_ref` (``torch.topk``).
    """
    _check_top_pages_args(scores, k)
    if not use_triton(scores):
        return top_pages_ref(scores, k)
    seqs, heads, num_cols = scores.shape
    picks = min(k, num_cols)
    out = torch.empty(seqs, heads, picks, dtype=torch.int64, device=scores.device)
    if out.numel():
        tile = min(row_tile(num_cols, interpreted(scores)), _TOP_MAX_TILE)
        _top_pages_kernel[(seqs * heads,)](scores.contiguous(), out, num_cols, picks, BLOCK=tile,
                                           num_warps=8 if tile >= 2048 else 4)
    return out
