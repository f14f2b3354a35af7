"""Triton kernels of XAttention block-importance estimation: the CUDA path of
:func:`nanovllm.ops.xattn_estimate.xattn_block_scores`, whose docstring defines the scores (the steps
named here are its steps 1-5) and whose torch reference is
:func:`nanovllm.ops.xattn_estimate.xattn_block_scores_ref`; positions as in :mod:`nanovllm.ops.xattn_estimate`.

Pass A (:func:`_xattn_partials_kernel`) is the one pass over the strided GEMM (online-softmax row
statistics and partial block sums per key tile); pass B (:func:`_xattn_combine_kernel`) rescales and
sums them into normalised block scores. :func:`launch_block_scores` runs both.
"""

import torch

from nanovllm.utils.ints import cdiv

from ._triton import LOG2E, block_dim, both_or_neither, row_group_descriptor, row_tile
from .backend import interpreted, tl, triton


@triton.jit
def _strided_scores(
    q_src, k_src, r, j, r0, j0, q_col, k_col, seq_q, seq_k, d, d_mask, stride_qs, stride_ks,
    STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Raw strided scores Q'[r] . K'[j] = sum_i q[r*S + S-1-i] . k[j*S + i] (rows past the end
    read as zero), fp32 [BLOCK_M, BLOCK_N]; the reshape is done by the loads, never stored.
    Pointer loads from the heads' bases ``q_src``/``k_src``; TMA: tensor-descriptor loads of rows
    r0.., j0.. of q and k viewed as ``[rows / S, S * row stride]`` (column ``sub-row * row stride
    + head column``, ``q_col``/``k_col``)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(STRIDE):
        if TMA:
            qt = q_src.load([r0, (STRIDE - 1 - i) * stride_qs + q_col])
            kt = k_src.load([j0, i * stride_ks + k_col])
        else:
            q_rows = r * STRIDE + (STRIDE - 1 - i)
            k_rows = j * STRIDE + i
            qt = tl.load(q_src + q_rows[:, None] * stride_qs + d[None, :],
                         mask=(q_rows < seq_q)[:, None] & d_mask[None, :], other=0.0)
            kt = tl.load(k_src + k_rows[:, None] * stride_ks + d[None, :],
                         mask=(k_rows < seq_k)[:, None] & d_mask[None, :], other=0.0)
        acc += tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _strided_visible(r, j, offset, n_ks, STRIDE: tl.constexpr, CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] mask: strided key j exists and (causal) its first key is at or before the
    last query position of strided row r."""
    vis = (j < n_ks)[None, :] & (r >= 0)[:, None]
    if CAUSAL:
        vis = vis & (j[None, :] * STRIDE <= offset + r[:, None] * STRIDE + (STRIDE - 1))
    return vis


@triton.jit
def _key_end(r0, n_qs, n_ks, offset, STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Exclusive bound of the strided keys any row r0 .. r0 + BLOCK_M - 1 can see."""
    end = n_ks
    if CAUSAL:
        last_r = tl.minimum(r0 + BLOCK_M, n_qs) - 1
        lim = tl.maximum(offset + last_r * STRIDE + STRIDE, 0)
        end = tl.minimum(end, (lim + STRIDE - 1) // STRIDE)
    return end


@triton.jit
def _scaled_tile_scores(
    q_src, k_src, r, j, r0, j0, q_col, k_col, seq_q, seq_k, n_ks, offset, scale_log2, d, d_mask, stride_qs,
    stride_ks, STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Step 2 for one tile: ``A[r, j]`` in log2 units (scores * scale / S * log2(e)), -inf where
    hidden; fp32 [BLOCK_M, BLOCK_N]. Sources as :func:`_strided_scores`."""
    s = _strided_scores(q_src, k_src, r, j, r0, j0, q_col, k_col, seq_q, seq_k, d, d_mask, stride_qs, stride_ks,
                        STRIDE, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA) * scale_log2
    return tl.where(_strided_visible(r, j, offset, n_ks, STRIDE, CAUSAL), s, float("-inf"))


@triton.jit
def _online_softmax_tile(s, m_i, l_i):
    """FlashAttention-2's online-softmax statistics over one more tile ``s`` [M, N] (log2 units,
    -inf where hidden): returns ``(m_new, p, l_new)`` with ``m_new`` the running row max (-inf
    while a row has seen no key), ``p = exp2(s - m_new)`` (0 for such rows) and ``l_new`` the
    running row sum of exp2 rescaled to ``m_new``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, p, l_i * tl.exp2(m_i - m_safe) + tl.sum(p, 1)


@triton.jit
def _partials_tile(
    q_src, k_src, part_head, tile_max_head, r, r0, j0, q_col, k_col, m_i, l_i, seq_q, seq_k, n_qs, n_ks, n_k,
    offset, scale_log2, d, d_mask, stride_qs, stride_ks, stride_pk, stride_tt,
    STRIDE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """One key tile of pass A: the online-softmax update of ``(m_i, l_i)`` and, with ``m_new``
    the updated running max, ``part[kb, r] = sum_{j in kb} exp2(A[r, j] - m_new[r])`` for the
    tile's ``BLOCK_N // TILE`` key blocks and ``tile_max[tile, r] = m_new[r]``. Returns
    ``(m_new, l_new)``."""
    s = _scaled_tile_scores(q_src, k_src, r, j0 + tl.arange(0, BLOCK_N), r0, j0, q_col, k_col, seq_q, seq_k,
                            n_ks, offset, scale_log2, d, d_mask, stride_qs, stride_ks, STRIDE, BLOCK_M, BLOCK_N,
                            CAUSAL, DOT_PRECISION, TMA)
    m_new, p, l_i = _online_softmax_tile(s, m_i, l_i)
    part = tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_N // TILE, TILE)), axis=2)
    k_blocks = j0 // TILE + tl.arange(0, BLOCK_N // TILE)
    r_mask = r < n_qs
    tl.store(part_head + k_blocks[None, :] * stride_pk + r[:, None], part,
             mask=r_mask[:, None] & (k_blocks < n_k)[None, :])
    tl.store(tile_max_head + (j0 // BLOCK_N) * stride_tt + r, m_new, mask=r_mask)
    return m_new, l_i


@triton.jit(do_not_specialize=["seq_q", "seq_k", "n_qs", "n_ks", "n_k", "offset", "stride_ph", "stride_pk",
                                "stride_th", "stride_tt", "stride_mh"])
def _xattn_partials_kernel(
    q_ptr, k_ptr, q_desc, k_desc, part_ptr, tile_max_ptr, m_ptr, l_ptr, seq_q, seq_k, n_qs, n_ks, n_k, offset,
    scale_log2, stride_qs, stride_qh, stride_ks, stride_kh, stride_ph, stride_pk, stride_th, stride_tt, stride_mh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Pass A, the only pass over the strided GEMM: for BLOCK_M strided query rows of one q head,
    every visible key tile's partial block sums and running row max (:func:`_partials_tile`),
    then the final row max ``m`` (log2 units) and sum ``l``. Key tiles past the rows' causal
    limit are skipped, their ``part``/``tile_max`` entries left unwritten. Row blocks run last to
    first (the causally longest first). TMA: q and k through the descriptors of
    :func:`_strided_descriptors`, else through pointers."""
    h = tl.program_id(0).to(tl.int64)
    r0 = (tl.num_programs(1) - 1 - tl.program_id(1)).to(tl.int64) * BLOCK_M
    r = r0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_col = (h * stride_qh).to(tl.int32)
    k_col = ((h // GROUP) * stride_kh).to(tl.int32)
    if TMA:
        q_src = q_desc
        k_src = k_desc
    else:
        q_src = q_ptr + h * stride_qh
        k_src = k_ptr + (h // GROUP) * stride_kh
    part_head = part_ptr + h * stride_ph
    tile_max_head = tile_max_ptr + h * stride_th
    end = _key_end(r0, n_qs, n_ks, offset, STRIDE, BLOCK_M, CAUSAL)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if WHILE_LOOP:  # Triton's interpreter cannot take tensor bounds in range()
        j0 = end * 0
        while j0 < end:
            m_i, l_i = _partials_tile(q_src, k_src, part_head, tile_max_head, r, r0.to(tl.int32), j0.to(tl.int32),
                                      q_col, k_col, m_i, l_i, seq_q, seq_k, n_qs, n_ks, n_k, offset, scale_log2, d,
                                      d_mask, stride_qs, stride_ks, stride_pk, stride_tt, STRIDE, TILE, BLOCK_M,
                                      BLOCK_N, CAUSAL, DOT_PRECISION, TMA)
            j0 += BLOCK_N
    else:
        for j0 in tl.range(0, end, BLOCK_N, flatten=True):
            m_i, l_i = _partials_tile(q_src, k_src, part_head, tile_max_head, r, r0.to(tl.int32), j0.to(tl.int32),
                                      q_col, k_col, m_i, l_i, seq_q, seq_k, n_qs, n_ks, n_k, offset, scale_log2, d,
                                      d_mask, stride_qs, stride_ks, stride_pk, stride_tt, STRIDE, TILE, BLOCK_M,
                                      BLOCK_N, CAUSAL, DOT_PRECISION, TMA)
    r_mask = r < n_qs
    tl.store(m_ptr + h * stride_mh + r, m_i, mask=r_mask)
    tl.store(l_ptr + h * stride_mh + r, l_i, mask=r_mask)


@triton.jit
def _combine_chunk(
    part_head, tile_max_head, out_row, r, kb0, m_safe, inv_l, inv_rows, row_ok, n_ks, n_k, offset, stride_pk,
    stride_tt, STRIDE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Pass B for key blocks ``kb0 .. kb0 + BLOCK_KB - 1`` of one query block (see
    :func:`_xattn_combine_kernel`). Row r reads block kb only if it sees the block's first
    strided key, i.e. any of its keys: pass A wrote those entries whatever rows its programs held."""
    kb = kb0 + tl.arange(0, BLOCK_KB)
    mask = _strided_visible(r, kb * TILE, offset, n_ks, STRIDE, CAUSAL) & row_ok[:, None]
    part = tl.load(part_head + kb[None, :] * stride_pk + r[:, None], mask=mask, other=0.0)
    tile_max = tl.load(tile_max_head + (kb * TILE // BLOCK_N)[None, :] * stride_tt + r[:, None], mask=mask,
                       other=float("-inf"))
    probs = part * tl.exp2(tile_max - m_safe[:, None]) * inv_l[:, None]
    tl.store(out_row + kb, tl.sum(probs, 0) * inv_rows, mask=kb < n_k)


@triton.jit(do_not_specialize=["n_qs", "n_ks", "n_k", "offset", "stride_ph", "stride_pk", "stride_th", "stride_tt",
                                "stride_mh", "stride_oh", "stride_oq"])
def _xattn_combine_kernel(
    part_ptr, tile_max_ptr, m_ptr, l_ptr, out_ptr, n_qs, n_ks, n_k, offset,
    stride_ph, stride_pk, stride_th, stride_tt, stride_mh, stride_oh, stride_oq,
    STRIDE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
    CAUSAL: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Pass B, memory-bound: for query block ``qb`` of one q head, each key block's score
    ``sum_{r in qb} part[kb, r] * exp2(tile_max[tile(kb), r] - m[r]) / l[r]`` (the softmax
    probabilities summed over the block, steps 3-4) divided by the number of the block's rows
    that see a key (each such row's probabilities sum to 1, so this is step 5). Rows without keys
    and causally hidden blocks give exactly 0."""
    qb = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r = qb * TILE + tl.arange(0, TILE)
    r_mask = r < n_qs
    m_i = tl.load(m_ptr + h * stride_mh + r, mask=r_mask, other=float("-inf"))
    l_i = tl.load(l_ptr + h * stride_mh + r, mask=r_mask, other=0.0)
    row_ok = r_mask & (l_i > 0)
    m_safe = tl.where(row_ok, m_i, 0.0)
    inv_l = tl.where(row_ok, 1.0 / tl.where(row_ok, l_i, 1.0), 0.0)
    n_rows = tl.sum(row_ok.to(tl.float32), 0)
    inv_rows = tl.where(n_rows > 0, 1.0 / tl.maximum(n_rows, 1.0), 0.0)
    part_head = part_ptr + h * stride_ph
    tile_max_head = tile_max_ptr + h * stride_th
    out_row = out_ptr + h * stride_oh + qb * stride_oq
    if WHILE_LOOP:  # Triton's interpreter cannot take tensor bounds in range()
        kb0 = n_k * 0
        while kb0 < n_k:
            _combine_chunk(part_head, tile_max_head, out_row, r, kb0, m_safe, inv_l, inv_rows, row_ok, n_ks, n_k,
                           offset, stride_pk, stride_tt, STRIDE, TILE, BLOCK_N, BLOCK_KB, CAUSAL)
            kb0 += BLOCK_KB
    else:
        for kb0 in range(0, n_k, BLOCK_KB):
            _combine_chunk(part_head, tile_max_head, out_row, r, kb0, m_safe, inv_l, inv_rows, row_ok, n_ks, n_k,
                           offset, stride_pk, stride_tt, STRIDE, TILE, BLOCK_N, BLOCK_KB, CAUSAL)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _partials_config(q, stride, block_size, causal) -> dict:
    """Constexprs and launch options of pass A: tiles of BLOCK_M strided rows x BLOCK_N strided
    keys, 128 x 128 (64 x 64 where a row of q is over 256 bytes: head_dim > 128, or float32 and
    head_dim > 64); BLOCK_N a multiple of TILE = block_size // stride (a tile holds whole key
    blocks), BLOCK_M shrunk as BLOCK_N grows past 128 (accumulator <= 128 x 128 fp32); as many
    pipeline stages of the (BLOCK_M + BLOCK_N) x BLOCK_D q/k loads as fit in 192 KiB, at most 4."""
    block_d = block_dim(q.shape[2])
    tile = block_size // stride
    base = 128 if block_d * q.element_size() <= 256 else 64
    block_n = max(base, tile)
    block_m = max(16, min(base, 128 * 128 // block_n))
    stage_bytes = (block_m + block_n) * block_d * q.element_size()
    return dict(
        HEAD_DIM=q.shape[2], BLOCK_D=block_d, STRIDE=stride, TILE=tile, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=not q.is_cuda, num_warps=8 if block_m * block_n >= 128 * 128 else 4,
        num_stages=max(1, min(4, 192 * 1024 // stage_bytes)),
    )


def _strided_descriptors(q: torch.Tensor, k: torch.Tensor, stride: int, config: dict):
    """TMA tensor descriptors of q and k in groups of S rows
    (:func:`nanovllm.ops._triton.row_group_descriptor`: strided row r's sub-row ``S-1-i`` of head
    h is view row r at column ``(S-1-i) * row stride + h * D``), with ``[BLOCK_M, D]`` /
    ``[BLOCK_N, D]`` tiles; ``(None, None)`` where either is ruled out (e.g. Sq or Sk not a
    multiple of S, or a head-major layout)."""
    return both_or_neither(row_group_descriptor(q, stride, config["BLOCK_M"]),
                           row_group_descriptor(k, stride, config["BLOCK_N"]))


def launch_block_scores(q, k, stride, block_size, scale, causal, offset):
    """Pass A then pass B on the device: float32 ``[Hq, nQ, nK]`` block scores, rows normalised;
    ``offset`` is the key position of query row 0. Scratch (float32): partial block sums
    ``[Hq, nK, ceil(Sq/S)]``, tile maxima ``[Hq, ceil(Sk/(S*BLOCK_N)), ceil(Sq/S)]``, row max and
    sum ``[Hq, ceil(Sq/S)]``; pass B reads ``BLOCK_KB`` key blocks x TILE rows at a time, at most 2048
    (:func:`~nanovllm.ops._triton.row_tile` of nK: a single width, 128, for the default TILE of 16)."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    (seq_q, heads_q, _), seq_k = q.shape, k.shape[0]
    config = _partials_config(q, stride, block_size, causal)
    n_qs, n_ks = cdiv(seq_q, stride), cdiv(seq_k, stride)
    n_q, n_k = cdiv(seq_q, block_size), cdiv(seq_k, block_size)
    part = torch.empty((heads_q, n_k, n_qs), dtype=torch.float32, device=q.device)
    tile_max = torch.empty((heads_q, cdiv(n_ks, config["BLOCK_N"]), n_qs), dtype=torch.float32, device=q.device)
    m_buf = torch.empty((heads_q, n_qs), dtype=torch.float32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    q_desc, k_desc = _strided_descriptors(q, k, stride, config)
    _xattn_partials_kernel[(heads_q, cdiv(n_qs, config["BLOCK_M"]))](
        q, k, q_desc, k_desc, part, tile_max, m_buf, l_buf, seq_q, seq_k, n_qs, n_ks, n_k, offset,
        scale / stride * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), part.stride(0), part.stride(1),
        tile_max.stride(0), tile_max.stride(1), m_buf.stride(0), GROUP=heads_q // k.shape[1],
        TMA=q_desc is not None, **config,
    )
    out = torch.empty((heads_q, n_q, n_k), dtype=torch.float32, device=q.device)
    tile = config["TILE"]
    block_kb = min(row_tile(n_k, interpreted(q)), max(1, 2048 // tile))
    _xattn_combine_kernel[(n_q, heads_q)](
        part, tile_max, m_buf, l_buf, out, n_qs, n_ks, n_k, offset, part.stride(0), part.stride(1),
        tile_max.stride(0), tile_max.stride(1), m_buf.stride(0), out.stride(0), out.stride(1),
        STRIDE=stride, TILE=tile, BLOCK_N=config["BLOCK_N"], BLOCK_KB=block_kb,
        CAUSAL=bool(causal), WHILE_LOOP=config["WHILE_LOOP"], num_warps=4,
    )
    return out
