"""Block-sparse attention: attention restricted to a per-(head, query block) set of key blocks.

The block mask usually comes from XAttention's selection
(:func:`nanovllm.ops.xattn_select.xattn_select_blocks`; Xu et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025), whose paper runs it on MIT-Han-Lab's
Block-Sparse-Attention kernels. Here the CUDA path is our own Triton kernel: FlashAttention-2's
forward (Dao 2023; online softmax in fp32 with exp2) over, per query tile, only the key blocks its
query block keeps. The kept blocks come as two lists built on the device from the mask: *full*
blocks (every key visible to every row: no masks) and *partial* ones (crossing the causal diagonal
or the end of the keys), each walked in one flat loop of key tiles so Triton pipelines the K/V
loads (TMA bulk copies where allowed) across blocks. It needs no torch.compile and runs under
Triton's interpreter in the CPU tests. Its time against cuDNN's dense causal attention and the
alternatives tried: docs/benchmarks.md, 'XAttention kernels at 32K', and docs/ops.md.
"""

import torch

from nanovllm.utils.ints import cdiv, is_pow2

from ._triton import (LOG2E, block_dim, both_or_neither, check_causal, check_float_dtype, check_gqa, check_head_dim,
                      check_same_device, check_scale, online_softmax_step, row_group_descriptor)
from .backend import tl, triton, use_triton
from .block_lists import kept_block_lists


def check_window(window, causal: bool) -> int | None:
    """``window`` (None or an int >= 1, with causal); ValueError naming it otherwise."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not causal):
        raise ValueError(f"window={window!r} must be None or an int >= 1 with causal=True")
    return window


def _check_args(q, k, v, mask, block_size) -> None:
    check_same_device(q=q, k=k, v=v, mask=mask)
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [Sq, Hq, D] and k, v [Sk, Hkv, D] of one shape and D; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])
    check_float_dtype(q=q, k=k, v=v)
    if not is_pow2(block_size) or not 16 <= block_size <= 1024:
        raise ValueError(f"block_size={block_size!r} must be a power of two in 16..1024")
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
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`block_sparse_attention` (same arguments and results): dense fp32
    scores (float64 inputs: float64) with -inf outside the kept blocks and, if causal, above the
    bottom-right diagonal and before the window; one head and at most 4096 query rows at a time."""
    _check_args(q, k, v, mask, block_size)
    block_size, scale, causal = int(block_size), check_scale(scale), check_causal(causal)
    window = check_window(window, causal)
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
                if window is not None:
                    allowed = allowed & (key_pos[None, :] > q_pos[:, None] - window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[:, None])
            out[rows, h] = (probs @ vf).to(q.dtype)
            lse[h, rows] = row_lse.float()
    return out, lse


@triton.jit
def _load_kv(k_src, v_src, pos, pos0, col, key_end, d, d_mask, stride_ks, stride_vs, MASKED: tl.constexpr,
             EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_D]`` K and V tiles at positions ``pos`` (``pos0`` the first). TMA:
    tensor-descriptor loads (bulk copies on sm_90; keys past the end read as zero); else pointer
    loads from the head's base, masked past ``key_end`` when MASKED and past head_dim unless
    EVEN_D."""
    if TMA:
        k = k_src.load([pos0, col])
        v = v_src.load([pos0, col])
    else:
        k_ptrs = k_src + pos[:, None] * stride_ks + d[None, :]
        v_ptrs = v_src + pos[:, None] * stride_vs + d[None, :]
        if MASKED:
            kv_mask = (pos < key_end)[:, None] & d_mask[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _bsa_tile(
    q, k_src, v_src, index_row, t, tiles, block, col, key_end, q_pos, window, m_i, l_i, acc, d, d_mask, scale_log2,
    stride_ks, stride_vs, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """One online-softmax step (FlashAttention-2) over tile t of a block list: tile ``t % TILES``
    of key block ``block`` (= ``index[t // TILES]``). Unmasked: every key is visible to every row
    (a *full* block). MASKED: keys >= key_end and, if causal, keys past a row's position ``q_pos``
    (WINDOWED: and keys at or before ``q_pos - window``) are hidden. Also loads and returns the
    block index of tile t + 1 (0 past the list), so its global-memory latency overlaps this tile:
    read at its own tile, it stalls every tile (docs/benchmarks.md, 'XAttention kernels at 32K')."""
    TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    next_block = tl.load(index_row + (t + 1) // TILES, mask=t + 1 < tiles, other=0)
    pos0 = block * BLOCK_SIZE + (t % TILES) * BLOCK_N
    pos = pos0.to(tl.int64) + tl.arange(0, BLOCK_N)
    k, v = _load_kv(k_src, v_src, pos, pos0, col, key_end, d, d_mask, stride_ks, stride_vs, MASKED, EVEN_D, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        vis = (pos < key_end)[None, :]
        if CAUSAL:
            vis = vis & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            vis = vis & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = online_softmax_step(tl.where(vis, s * scale_log2, float("-inf")), v, m_i, l_i, acc,
                                            DOT_PRECISION)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # every row sees every key: m_new finite
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i, l_i = m_new, l_i * alpha + tl.sum(p, 1)
    return m_i, l_i, acc, next_block


@triton.jit
def _bsa_list(
    q, k_src, v_src, col, count, index_row, key_end, q_pos, window, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks,
    stride_vs, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """The key tiles of the ``count`` blocks listed at ``index_row``, in one flat loop (tile t is
    tile ``t % TILES`` of block ``index[t // TILES]``), so Triton pipelines the K/V loads across
    blocks."""
    tiles = count * (BLOCK_SIZE // BLOCK_N)
    block = tl.load(index_row)  # a row holds nK >= 1 entries: in bounds even when count is 0
    if WHILE_LOOP:  # Triton's interpreter cannot take tensor bounds in range()
        t = count * 0
        while t < tiles:
            m_i, l_i, acc, block = _bsa_tile(q, k_src, v_src, index_row, t, tiles, block, col, key_end, q_pos,
                                             window, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs,
                                             BLOCK_SIZE, BLOCK_N, MASKED, CAUSAL, EVEN_D, TMA, DOT_PRECISION,
                                             WINDOWED)
            t += 1
    else:
        for t in range(0, tiles):
            m_i, l_i, acc, block = _bsa_tile(q, k_src, v_src, index_row, t, tiles, block, col, key_end, q_pos,
                                             window, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs,
                                             BLOCK_SIZE, BLOCK_N, MASKED, CAUSAL, EVEN_D, TMA, DOT_PRECISION,
                                             WINDOWED)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["seq_q", "seq_k", "offset", "window", "stride_ch", "stride_ih", "stride_iq",
                               "stride_lh"])
def _bsa_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, count_ptr, index_ptr, full_count_ptr, full_index_ptr, out_ptr, lse_ptr,
    seq_q, seq_k, offset, window, scale_log2, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_os, stride_oh, stride_ch, stride_ih, stride_iq, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr, WINDOWED: tl.constexpr,
):
    """BLOCK_M query rows of one q head: the full kept blocks without masks, then the partial
    ones (crossing the causal diagonal or the end of the keys) with masks. Query tiles run last
    to first (the causally longest first). TMA: K/V through the descriptors ``k_desc``/``v_desc``
    over ``[Sk, Hkv * D]`` (tile at row ``pos0``, column ``kv_head * D``), else through the
    pointers."""
    row0 = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64) * BLOCK_M
    h = tl.program_id(1)
    q_block = row0 // BLOCK_SIZE
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seq_q
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qs + h * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = rows + offset
    kv_head = h // GROUP
    col = kv_head * HEAD_DIM
    if TMA:
        k_src = k_desc
        v_src = v_desc
    else:
        k_src = k_ptr + kv_head * stride_kh
        v_src = v_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    lists = h * stride_ch + q_block
    rows_at = h * stride_ih + q_block * stride_iq
    m_i, l_i, acc = _bsa_list(q, k_src, v_src, col, tl.load(full_count_ptr + lists), full_index_ptr + rows_at, seq_k,
                              q_pos, window, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs, BLOCK_SIZE,
                              BLOCK_N, False, CAUSAL, EVEN_D, TMA, DOT_PRECISION, WHILE_LOOP, WINDOWED)
    m_i, l_i, acc = _bsa_list(q, k_src, v_src, col, tl.load(count_ptr + lists), index_ptr + rows_at, seq_k,
                              q_pos, window, m_i, l_i, acc, d, d_mask, scale_log2, stride_ks, stride_vs, BLOCK_SIZE,
                              BLOCK_N, True, CAUSAL, EVEN_D, TMA, DOT_PRECISION, WHILE_LOOP, WINDOWED)
    seen = l_i != 0  # 0: no key seen; NaN (NaN/inf inputs) propagates to out and lse
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_os + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + h * stride_lh + rows, lse, mask=row_mask)


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """Tensor descriptors of k and v viewed as ``[Sk, Hkv * D]`` with ``[block_n, D]`` tiles
    (:func:`nanovllm.ops._triton.row_group_descriptor` with groups of one row), or
    ``(None, None)`` where either is ruled out."""
    return both_or_neither(row_group_descriptor(k, 1, block_n), row_group_descriptor(v, 1, block_n))


def _tiles(q: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): 128 x 128 tiles, 8 warps where a row of q is at most 256 bytes
    (bf16/fp16 head_dim <= 128), else 64 x 64, 4 warps; tiles never exceed the block (a query tile
    lies in one query block, a key tile in one key block). Pipeline stages: :data:`STAGES`."""
    wide = block_dim(q.shape[2]) * q.element_size() <= 256
    block_m, block_n, warps = (128, 128, 8) if wide else (64, 64, 4)
    return min(block_m, block_size), min(block_n, block_size), warps


STAGES = {True: 3, False: 2}
"""Pipeline stages of the K/V loads with and without TMA: a third stage pays only with TMA (the
sweep of stages, tiles and warps: docs/benchmarks.md, 'XAttention kernels at 32K')."""


def _bsa_triton(q, k, v, mask, block_size, scale, causal, window=None):
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads_q, seq_q), dtype=torch.float32, device=q.device)
    full_count, full_index, count, index = kept_block_lists(mask, block_size, seq_q, seq_k, causal, window)
    block_m, block_n, warps = _tiles(q, block_size)
    k_desc, v_desc = _kv_descriptors(k, v, block_n)
    _bsa_kernel[(cdiv(seq_q, block_m), heads_q)](
        q, k, v, k_desc, v_desc, count, index, full_count, full_index, out, lse, seq_q, seq_k, seq_k - seq_q,
        window or 0, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), count.stride(0), index.stride(0), index.stride(1), lse.stride(0),
        GROUP=heads_q // heads_kv, HEAD_DIM=dim, BLOCK_D=block_dim(dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=bool(causal), TMA=k_desc is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOP=not q.is_cuda,
        WINDOWED=window is not None, num_warps=warps,
        num_stages=STAGES[k_desc is not None],
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
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the key blocks that ``mask`` keeps, with the log-sum-exp.

    Query row i (local; position ``Sk - Sq + i``) of query block ``i // block_size`` attends to key
    j iff ``mask[h, i // block_size, j // block_size]`` and, if causal, ``j <= Sk - Sq + i`` and, with
    a sliding window, ``j > Sk - Sq + i - window``.

    Args:
        q: ``[Sq, Hq, D]``; k, v: ``[Sk, Hkv, D]``; ``Hq % Hkv == 0`` (GQA: q head h uses kv head
            ``h // (Hq // Hkv)``), ``1 <= D <= 256``; float16/bfloat16/float32 (float64 goes to the
            reference); rows may be strided, the last dim is made contiguous if it is not.
        mask: bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]`` on q's device (e.g. from
            :func:`nanovllm.ops.xattn_select.xattn_select_blocks`).
        block_size: tokens per block, a power of two in 16..1024.
        scale: softmax scale, a finite real > 0 (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask inside the kept blocks.
        window: None, or a causal sliding window in tokens (an int >= 1; needs causal): kept blocks
            wholly before it are not read, those crossing its edge are masked per key.

    Returns:
        ``(out [Sq, Hq, D] in q.dtype, lse float32 [Hq, Sq])``, lse the natural log of the sum of
        exp(scaled scores) over the attended keys. Rows that see no key: out 0, lse -inf.

        NaN or inf in the inputs give NaN (or inf) in out and lse, as in the reference; never a
        silent -inf that a later LSE merge would drop.

    Raises:
        ValueError: q/k/v/mask not tensors on one device, shapes that disagree, Hq not a multiple
            of Hkv, D outside 1..256, block_size not a power of two in 16..1024, mask not bool of
            the shape above, scale not a finite real number > 0, causal not a bool, or window
            not None / an int >= 1 with causal.

    CUDA: the block lists (:func:`nanovllm.ops.block_lists.kept_block_lists`: one small kernel,
    no host sync), then one attention kernel (grid ``ceil(Sq/128) x Hq``; 128 query rows x 128-key tiles, 8 warps;
    rows over 256 bytes, e.g. head_dim > 128: 64 x 64, 4 warps; tiles no larger than the block),
    FlashAttention-2 online softmax over the kept blocks only: the full ones without masks, then
    the partial ones with them (:func:`nanovllm.ops.block_lists.full_layout`); work is
    proportional to the kept blocks.
    K and V come through TMA tensor descriptors (3 pipeline stages) where the bulk-copy rules
    allow (:func:`_kv_descriptors`: power-of-two head_dim, heads adjacent in a row, 16-byte
    aligned), else through pointer loads (2 stages). CPU: :func:`block_sparse_attention_ref` (or
    the kernels under the interpreter).
    """
    _check_args(q, k, v, mask, block_size)
    block_size, scale, causal = int(block_size), check_scale(scale), check_causal(causal)
    window = check_window(window, causal)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if q.dtype == torch.float64 or not use_triton(q):
        return block_sparse_attention_ref(q, k, v, mask, block_size, scale, causal, window)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return block_sparse_attention_ref(q, k, v, mask, block_size, scale, causal, window)
    return _bsa_triton(q, k, v, mask, block_size, scale, causal, window)
