"""Block-sparse attention: attention restricted to a per-(head, query block) set of key blocks.

The block mask usually comes from XAttention's selection
(:func:`nanovllm.ops.xattn_estimate.xattn_select_blocks`; Xu et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025), whose paper runs it on MIT-Han-Lab's
Block-Sparse-Attention kernels. Here the CUDA path is our own Triton kernel: FlashAttention-2's
forward (Dao 2023; online softmax in fp32 with exp2) walking, for each query tile, only the key
blocks its query block keeps, listed ascending in a compacted index built on the device from the
mask. FlexAttention (``torch.nn.attention.flex_attention``) would also do; the Triton kernel was
chosen because it needs no torch.compile, runs under Triton's interpreter in the CPU tests, and
takes the block list directly with no BlockMask conversion per call.
"""

import torch

from ._triton import (
    LOG2E, block_dim, cdiv, check_float_dtype, check_gqa, check_head_dim, is_pow2, online_softmax_step, tl, triton,
    use_triton,
)


def _check_args(q, k, v, mask, block_size) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [Sq, Hq, D] and k, v [Sk, Hkv, D] of one shape and D; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])
    check_float_dtype(q=q, k=k, v=v)
    if not is_pow2(block_size) or not 16 <= block_size <= 1024:
        raise ValueError(f"block_size={block_size} must be a power of two in 16..1024")
    if mask.device != q.device:
        raise ValueError(f"mask must be on q's device {q.device}; got {mask.device}")
    expected = (q.shape[1], cdiv(q.shape[0], block_size), cdiv(k.shape[0], block_size))
    if mask.dtype != torch.bool or tuple(mask.shape) != expected:
        raise ValueError(
            f"mask must be bool [Hq, ceil(Sq/{block_size}), ceil(Sk/{block_size})] = {expected}; got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )


def block_sparse_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`block_sparse_attention` (same arguments and results): dense fp32
    scores (float64 inputs: float64) with -inf outside the kept blocks and, if causal, above the
    bottom-right diagonal; one head and at most 4096 query rows at a time."""
    _check_args(q, k, v, mask, block_size)
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    group = heads_q // heads_kv
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((heads_q, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    if seq_q == 0 or seq_k == 0:
        return out, lse
    key_pos = torch.arange(seq_k, device=q.device)
    chunk = 4096
    for h in range(heads_q):
        kf = k[:, h // group].to(dtype)
        vf = v[:, h // group].to(dtype)
        token_mask = mask[h].repeat_interleave(block_size, 0)[:seq_q].repeat_interleave(block_size, 1)[:, :seq_k]
        for r0 in range(0, seq_q, chunk):
            rows = slice(r0, min(r0 + chunk, seq_q))
            scores = (q[rows, h].to(dtype) @ kf.T) * scale
            allowed = token_mask[rows]
            if causal:
                q_pos = torch.arange(rows.start, rows.stop, device=q.device) + (seq_k - seq_q)
                allowed = allowed & (key_pos[None, :] <= q_pos[:, None])
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[:, None])
            out[rows, h] = (probs @ vf).to(q.dtype)
            lse[h, rows] = row_lse.float()
    return out, lse


@triton.jit
def _bsa_tile(
    q, k_head, v_head, n0, hi, q_pos, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N - 1. MASKED: keys >= hi, rows with
    q_pos < 0 and (if causal) keys past a row's position are masked; else every key of the tile
    is visible to every row (an interior tile: no masks, plain loads)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    k_ptrs = k_head + pos[:, None] * stride_ks + d[None, :]
    v_ptrs = v_head + pos[:, None] * stride_vs + d[None, :]
    if MASKED:
        n_mask = pos < hi
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        vis = n_mask[None, :] & (q_pos >= 0)[:, None]
        if CAUSAL:
            vis = vis & (pos[None, :] <= q_pos[:, None])
        s = tl.where(vis, s, float("-inf"))
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _bsa_span(
    q, k_head, v_head, start, end, q_pos, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Tiles of keys start .. end - 1 (``end`` also bounds the last masked tile)."""
    if WHILE_LOOP:  # Triton's interpreter cannot take tensor bounds in range()
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _bsa_tile(q, k_head, v_head, n0, end, q_pos, m_i, l_i, acc, d, d_mask, scale_log2,
                                      stride_ks, stride_vs, BLOCK_N, CAUSAL, MASKED, EVEN_D, DOT_PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _bsa_tile(q, k_head, v_head, n0, end, q_pos, m_i, l_i, acc, d, d_mask, scale_log2,
                                      stride_ks, stride_vs, BLOCK_N, CAUSAL, MASKED, EVEN_D, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _bsa_block(
    q, k_head, v_head, lo, key_end, full_limit, q_pos, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks,
    stride_vs, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """One kept key block [lo, lo + BLOCK_SIZE): its interior tiles (every key below
    ``full_limit``, visible to every row of the query tile) unmasked, the rest masked."""
    hi = tl.minimum(lo + BLOCK_SIZE, key_end)
    full_end = lo + tl.maximum(tl.minimum(hi, full_limit) - lo, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _bsa_span(q, k_head, v_head, lo, full_end, q_pos, m_i, l_i, acc, d, d_mask, scale_log2,
                              stride_ks, stride_vs, BLOCK_N, CAUSAL, False, EVEN_D, DOT_PRECISION, WHILE_LOOP)
    return _bsa_span(q, k_head, v_head, full_end, hi, q_pos, m_i, l_i, acc, d, d_mask, scale_log2,
                     stride_ks, stride_vs, BLOCK_N, CAUSAL, True, EVEN_D, DOT_PRECISION, WHILE_LOOP)


@triton.jit
def _bsa_kernel(
    q_ptr, k_ptr, v_ptr, count_ptr, index_ptr, out_ptr, lse_ptr, seq_q, seq_k, offset, scale_log2,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_oh,
    stride_ch, stride_ih, stride_iq, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    h = tl.program_id(1)
    q_block = row0 // BLOCK_SIZE
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seq_q
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qs + h * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = rows + offset
    k_head = k_ptr + (h // GROUP) * stride_kh
    v_head = v_ptr + (h // GROUP) * stride_vh
    count = tl.load(count_ptr + h * stride_ch + q_block)
    index_row = index_ptr + h * stride_ih + q_block * stride_iq
    key_end = seq_k + row0 * 0  # int64 like the causal bound
    full_limit = key_end  # keys below it are visible to every row of this tile
    if CAUSAL:
        key_end = tl.minimum(key_end, offset + tl.minimum(row0 + BLOCK_M, seq_q))
        full_limit = tl.minimum(key_end, offset + row0 + 1)
    full_limit = tl.where(offset + row0 >= 0, full_limit, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    if WHILE_LOOP:
        n = count * 0
        while n < count:
            lo = tl.load(index_row + n).to(tl.int64) * BLOCK_SIZE
            m_i, l_i, acc = _bsa_block(q, k_head, v_head, lo, key_end, full_limit, q_pos, m_i, l_i, acc, d,
                                       d_mask, scale_log2, stride_ks, stride_vs, BLOCK_SIZE, BLOCK_N, CAUSAL,
                                       EVEN_D, DOT_PRECISION, WHILE_LOOP)
            n += 1
    else:
        for n in range(0, count):
            lo = tl.load(index_row + n).to(tl.int64) * BLOCK_SIZE
            m_i, l_i, acc = _bsa_block(q, k_head, v_head, lo, key_end, full_limit, q_pos, m_i, l_i, acc, d,
                                       d_mask, scale_log2, stride_ks, stride_vs, BLOCK_SIZE, BLOCK_N, CAUSAL,
                                       EVEN_D, DOT_PRECISION, WHILE_LOOP)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_os + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + h * stride_lh + rows, lse, mask=row_mask)


def _block_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count int32 [Hq, nQ], index int32 [Hq, nQ, nK]): kept key blocks first, ascending. On the
    device, no host sync."""
    count = mask.sum(-1, dtype=torch.int32)
    index = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), index.contiguous()


def _bsa_triton(q, k, v, mask, block_size, scale, causal):
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads_q, seq_q), dtype=torch.float32, device=q.device)
    block_d = block_dim(dim)
    block_m, block_n, warps, stages = (128, 64, 8, 3) if block_d <= 128 else (64, 32, 4, 2)
    block_m, block_n = min(block_m, block_size), min(block_n, block_size)
    count, index = _block_lists(mask)
    _bsa_kernel[(cdiv(seq_q, block_m), heads_q)](
        q, k, v, count, index, out, lse, seq_q, seq_k, seq_k - seq_q, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        count.stride(0), index.stride(0), index.stride(1), lse.stride(0),
        GROUP=heads_q // heads_kv, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=bool(causal), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=not q.is_cuda, num_warps=warps, num_stages=stages,
    )
    return out, lse


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the key blocks that ``mask`` keeps, with the log-sum-exp.

    Query row i (local; position ``Sk - Sq + i``) of query block ``i // block_size`` attends to key
    j iff ``mask[h, i // block_size, j // block_size]`` and, if causal, ``j <= Sk - Sq + i``.

    Args:
        q: ``[Sq, Hq, D]``; k, v: ``[Sk, Hkv, D]``; ``Hq % Hkv == 0`` (GQA: q head h uses kv head
            ``h // (Hq // Hkv)``), ``1 <= D <= 256``; float16/bfloat16/float32 (float64 goes to the
            reference); rows may be strided, the last dim is made contiguous if it is not.
        mask: bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]`` on q's device (e.g. from
            :func:`nanovllm.ops.xattn_estimate.xattn_select_blocks`).
        block_size: tokens per block, a power of two in 16..1024.
        scale: softmax scale (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask inside the kept blocks.

    Returns:
        ``(out [Sq, Hq, D] in q.dtype, lse float32 [Hq, Sq])``, lse the natural log of the sum of
        exp(scaled scores) over the attended keys. Rows that see no key: out 0, lse -inf.

    Raises:
        ValueError: shapes that disagree, Hq not a multiple of Hkv, D outside 1..256, block_size
            not a power of two in 16..1024, or mask not bool of the shape above.

    CUDA: one Triton kernel (grid ``ceil(Sq/128) x Hq``; 128 query rows x 64-key tiles, 8 warps,
    3 stages; D > 128: 64 x 32, 4 warps), FlashAttention-2 online softmax over the kept blocks
    only, key tiles past the causal bound skipped, interior tiles (below the tile's diagonal and
    inside the keys) without masks; work is proportional to the kept blocks. The
    block list is compacted on the device (argsort of the mask), no host sync. CPU:
    :func:`block_sparse_attention_ref` (or the kernel under the interpreter).
    """
    _check_args(q, k, v, mask, block_size)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if q.dtype == torch.float64 or not use_triton(q):
        return block_sparse_attention_ref(q, k, v, mask, block_size, scale, causal)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return block_sparse_attention_ref(q, k, v, mask, block_size, scale, causal)
    return _bsa_triton(q, k, v, mask, block_size, scale, causal)
