"""XAttention block-importance estimation for block-sparse prefill.

Algorithm: XAttention (Xu, Guo, Han et al., "XAttention: Block Sparse Attention with Antidiagonal
Scoring", 2025). The sum of the attention scores along antidiagonals of each ``stride x stride``
tile is a cheap proxy for the tile's total; it is computed for every tile at once as one GEMM of
stride-interleaved ("reshaped") Q and K, softmaxed at that reduced resolution and summed into
``block_size x block_size`` blocks. Per query block the highest-scoring key blocks are kept until
their cumulative share reaches a threshold (:mod:`nanovllm.ops.xattn_select`). The selected mask
drives :func:`nanovllm.ops.block_sparse_attention.block_sparse_attention`.

Positions: queries are the last ``Sq`` of the ``Sk`` keys (bottom-right aligned, as in
:func:`nanovllm.ops.flash_attn_with_lse`): local query row ``i`` sits at key position
``Sk - Sq + i``, or ``offset + i`` where an estimate takes an explicit ``offset``. Query block
``b`` is rows ``b*block_size .. (b+1)*block_size - 1`` (local), key block ``c`` is key positions
``c*block_size ..``; the last block of each may be partial.
"""

import torch

from ._triton import (
    LOG2E, block_dim, both_or_neither, cdiv, check_causal, check_float_dtype, check_gqa, check_head_dim, check_offset,
    check_same_device, check_scale, interpreted, is_pow2, row_group_descriptor, row_tile, tl, triton, use_triton,
)


def _check_qk(q: torch.Tensor, k: torch.Tensor, stride: int) -> int:
    """Raise ValueError for bad q/k/stride (see :func:`xattn_block_scores`); returns stride as an
    int (numpy integers pass the check and must not reach Triton)."""
    check_same_device(q=q, k=k)
    if q.dim() != 3 or k.dim() != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [Sq, Hq, D] and k [Sk, Hkv, D] with one D; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])
    check_float_dtype(q=q, k=k)
    if not is_pow2(stride) or stride > 64:
        raise ValueError(f"stride={stride!r} must be a power of two in 1..64")
    return int(stride)


def query_offset(q: torch.Tensor, k: torch.Tensor, offset) -> int:
    """The key position of query row 0: ``offset`` checked to be an int, default ``Sk - Sq``."""
    offset = check_offset(offset)
    return k.shape[0] - q.shape[0] if offset is None else offset


def _check_estimate_args(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> tuple[int, int]:
    """:func:`_check_qk` and the block size; returns ``(stride, block_size)`` as ints."""
    stride = _check_qk(q, k, stride)
    if not is_pow2(block_size) or block_size < stride or block_size > 1024:
        raise ValueError(
            f"block_size={block_size!r} must be a power of two in stride={stride}..1024"
        )
    return stride, int(block_size)


def _strided_layout(q: torch.Tensor, k: torch.Tensor, stride: int, causal: bool, offset: int):
    """Torch form of steps 1-2 of :func:`xattn_block_scores` for the references:
    ``(q_str [Hq, n_qs, S*D], k_str [Hkv, n_ks, S*D], visible bool [n_qs, n_ks])`` in float32
    (float64 inputs: float64), with query row 0 at key position ``offset``."""
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    n_qs, n_ks = cdiv(seq_q, stride), cdiv(seq_k, stride)
    q_pad = torch.zeros((n_qs * stride, heads_q, dim), dtype=dtype, device=q.device)
    q_pad[:seq_q] = q
    k_pad = torch.zeros((n_ks * stride, heads_kv, dim), dtype=dtype, device=q.device)
    k_pad[:seq_k] = k
    # Q'[h, r] = concat_i q[r*stride + stride-1-i, h]; K'[g, j] = concat_i k[j*stride + i, g].
    q_str = q_pad.view(n_qs, stride, heads_q, dim).flip(1).permute(2, 0, 1, 3).reshape(heads_q, n_qs, stride * dim)
    k_str = k_pad.view(n_ks, stride, heads_kv, dim).permute(2, 0, 1, 3).reshape(heads_kv, n_ks, stride * dim)
    rows = torch.arange(n_qs, device=q.device)
    cols = torch.arange(n_ks, device=q.device)
    if causal:
        visible = cols[None, :] * stride <= offset + rows[:, None] * stride + stride - 1
    else:
        visible = torch.ones((n_qs, n_ks), dtype=torch.bool, device=q.device)
    return q_str, k_str, visible


def xattn_block_scores_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    stride: int = 8,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
    offset: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`xattn_block_scores` (same arguments and result).

    Materialises the reshaped Q'/K' and one head's ``[Sq/stride, Sk/stride]`` score matrix at a
    time, in float32 (float64 inputs compute in float64); the result is float32.
    """
    stride, block_size = _check_estimate_args(q, k, stride, block_size)
    offset = query_offset(q, k, offset)
    scale, causal = check_scale(scale), check_causal(causal)
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    group = heads_q // heads_kv
    tile = block_size // stride
    n_q, n_k = cdiv(seq_q, block_size), cdiv(seq_k, block_size)
    out = torch.zeros((heads_q, n_q, n_k), dtype=torch.float32, device=q.device)
    if seq_q == 0 or seq_k == 0:
        return out
    q_str, k_str, visible = _strided_layout(q, k, stride, causal, offset)
    n_qs, n_ks = visible.shape
    any_visible = visible.any(-1, keepdim=True)
    for h in range(heads_q):
        scores = (q_str[h] @ k_str[h // group].T) * (scale / stride)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.where(any_visible, torch.softmax(scores, dim=-1), 0.0)
        padded = torch.zeros((n_q * tile, n_k * tile), dtype=q_str.dtype, device=q.device)
        padded[:n_qs, :n_ks] = probs
        out[h] = padded.view(n_q, tile, n_k, tile).sum(dim=(1, 3)).float()
    return normalise_block_rows(out)


def normalise_block_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row ``scores[..., qb, :]`` divided by its sum (rows summing to 0 stay 0): step 5 of
    :func:`xattn_block_scores`, for block sums assembled from pieces."""
    total = scores.sum(-1, keepdim=True)
    return torch.where(total > 0, scores / torch.where(total > 0, total, 1.0), 0.0)


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


def _launch_block_scores(q, k, stride, block_size, scale, causal, offset):
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


def xattn_block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    stride: int = 8,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
    offset: int | None = None,
) -> torch.Tensor:
    """XAttention antidiagonal block-importance scores.

    With ``S = stride``, ``T = block_size // S``, zero rows appended to q and k up to multiples
    of S, and for each q head ``h`` (kv head ``g = h // (Hq // Hkv)``):

    1. reshape (inverse mode): ``Q'[r] = concat_{i<S} q[r*S + S-1-i, h]`` and
       ``K'[j] = concat_{i<S} k[j*S + i, g]`` (length ``S*D``), for ``r < ceil(Sq/S)``,
       ``j < ceil(Sk/S)``; so ``Q'[r].K'[j]`` is the sum of q.k along the antidiagonal of the
       ``S x S`` tile (query rows ``r*S..``, keys ``j*S..``);
    2. ``A[r, j] = Q'[r].K'[j] * scale / S``; causal: ``A[r, j] = -inf`` unless
       ``j*S <= offset + r*S + S - 1`` (the tile's first key is at or before its last query
       position; by default ``offset = Sk - Sq``, bottom-right alignment);
    3. ``P = softmax_j(A)`` per strided row (a row with no visible key is all 0);
    4. ``B[qb, kb] = sum of P[r, j]`` over ``r // T == qb``, ``j // T == kb``;
    5. each row ``B[qb, :]`` divided by its sum (rows summing to 0 stay 0).

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hkv, D]``; ``Hq % Hkv == 0``, ``1 <= D <= 256``;
            float16/bfloat16/float32 (float64 goes to the reference); last dim contiguous or not.
        stride: S, a power of two in 1..64 (paper default 8; 16 is cheaper and coarser).
        block_size: a power of two in ``stride..1024``; tokens per query/key block.
        scale: softmax scale of the real attention, a finite real > 0 (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask (queries are the last Sq of the Sk keys).
        offset: int, the key position of query row 0 when causal (default ``Sk - Sq``; ignored
            when not causal). Any int: negative puts the first rows before every key (their
            rows are 0), past ``Sk - Sq`` lets rows see all keys. Used for a chunk of query rows
            estimated against keys that run on past the chunk's last row (cut at a stride
            multiple), as :func:`nanovllm.ops.xattn_mask.xattn_block_mask` does.

    Returns:
        float32 ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]``, each row summing to 1 (0
        where the query block sees no key); causally hidden blocks are exactly 0.

    Raises:
        ValueError: q/k not 3-D or differing in D, Hq not a multiple of Hkv, D outside 1..256,
            q and k not of one float dtype, stride or block_size not a power of two in range,
            offset not an int, scale not a finite real > 0, causal not a bool.

    CUDA: the strided GEMM is computed once, in two Triton kernels. Pass A runs over tiles of
    128 strided rows x N strided keys (N = max(128, T), fewer rows when T > 128; 64 x max(64, T)
    where a head_dim row is over 256 bytes), the reshape done by the loads (no copy): TMA bulk
    copies through descriptors over q and k viewed as ``[rows / S, S * row stride]`` when Sq and
    Sk are multiples of S (:func:`_strided_descriptors`; 1.4x faster on the H200), else strided
    pointer loads; causally hidden key tiles skipped; per tile it updates each row's
    online-softmax max and sum (FA-2) and writes the row's partial block sums
    ``exp2(A - m_tile)`` with ``m_tile``, the running max they were taken against. Pass B
    (memory-bound) rescales them to each row's final max and sum, sums them over the block's rows
    and divides by the number of rows that see a key (step 5).
    ``Hq * Sq * Sk * D / S`` multiply-adds (causal: about half), 1/S of QK^T's. Scratch: float32
    partial sums, tile maxima and row statistics,
    ``4 * Hq * ceil(Sq/S) * (ceil(Sk/block_size) + ceil(Sk/(S*N)) + 2)`` bytes (152 MB for
    Sq = Sk = 32K, Hq = 32, S = 8, block_size = 128).
    CPU: :func:`xattn_block_scores_ref` (or the kernels under the interpreter, see
    ``nanovllm.ops._triton``).
    """
    stride, block_size = _check_estimate_args(q, k, stride, block_size)
    offset = query_offset(q, k, offset)
    scale, causal = check_scale(scale), check_causal(causal)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if q.dtype == torch.float64 or not use_triton(q) or q.shape[0] == 0 or k.shape[0] == 0:
        return xattn_block_scores_ref(q, k, stride, block_size, scale, causal, offset)
    return _launch_block_scores(q, k, stride, block_size, scale, causal, offset)
