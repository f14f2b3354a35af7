"""Paged decode attention: one new query token per sequence over its cached context.

The CUDA kernel follows Flash-Decoding (Dao et al., 2023): the context is split into chunks
(split-K); each program owns one (sequence, kv head, split), loads the q heads of its GQA group
once, walks its tokens in tiles through the block table with FlashAttention-2's online softmax
(fp32 running max, sum and accumulator), and writes a partial output plus its log-sum-exp. A
second kernel merges the splits by LSE. Programs of the same sequence's KV heads are adjacent in
the grid (the heads of a token share its cache row), and a tile's block id is loaded one tile
ahead, so that the K/V loads never wait for the block table. Programs start in row order: the
scheduler puts a decode batch's longest contexts first (``engine/scheduler.py::longest_first``),
so that no long program starts last, while the rest of the GPU idles.
"""

import functools

import torch

from nanovllm.utils.ints import cdiv

from ._triton import (LOG2E, MIN_DOT_ROWS, block_dim, fp8_word_loads, half_query, load_value_rows, next_pow2,
                      online_softmax_step, scaled_online_softmax_step)
from .backend import interpreted, tl, triton, use_triton
from .chunked_attention import flash_attn_with_lse_ref
from .decode_cpu import check_context_lens, check_decode_args, decode_cpu
from .kv_quant import dequantize

_BLOCK_G = MIN_DOT_ROWS
"""q heads per program: a GQA group (padded) or a 16-head slice of a larger one."""
_UNSPLIT_PROGRAMS_PER_SM = 3
"""A batch with at least this many (sequence, KV head) programs per SM is not split: about as
many as fit on an SM at once, so the GPU is already full and splitting only adds the merge
(docs/ops.md, 'Splits only for an under-filled GPU')."""
_PROGRAMS_PER_SM = 12
"""Below that, split-K aims at this many programs per SM (chosen on bench.py's decode batches:
docs/ops.md, 'Splits only for an under-filled GPU')."""
_MAX_SPLITS = 32
"""Most splits chosen automatically; the merge kernel's compiled tile always covers this many, so
its one variant serves every context length."""
_MIN_SPLIT_TOKENS = 256
"""A split covers at least this many of the M * block_size token slots."""
_BLOCK_N = 64
"""KV tokens per tile over a 16-bit cache for head_dim <= 128 (half of it above); other tiles:
docs/ops.md, 'Measured on the H200'."""
_FP8_BLOCK_N = 128
"""KV tokens per tile over an fp8 cache for head_dim <= 128 (half of it above): the same bytes per
tile as a 16-bit cache's, so that the tile's fixed work (the online softmax's reductions, the
operand layout of the converted keys and values) is spread over twice the tokens (docs/ops.md,
'FP8 tiles, values read as words, float16 dots')."""
_NUM_WARPS = 4
_NUM_STAGES = 2


def split_block_n(scaled: bool, block_d: int) -> int:
    """KV tokens per tile of :func:`decode_split_kernel` (its ``BLOCK_N``) over an fp8 cache
    (``scaled``) or a 16-bit one, for a head_dim tile of ``block_d``."""
    return (_FP8_BLOCK_N if scaled else _BLOCK_N) // (1 if block_d <= 128 else 2)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    return_lse: bool = False,
    context_starts: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`decode_attention` (same arguments and result; one
    :func:`flash_attn_with_lse_ref` per sequence over its tokens ``context_starts[b] ..
    context_lens[b] - 1``, in float32 (fp8 keys and values dequantized), float64 inputs in float64;
    reads the lengths and starts on the host). Raises ValueError when a context length is outside
    0..max_blocks * block_size or a start outside 0..its length."""
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, context_starts, k_scale, v_scale)
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    lengths = context_lens.tolist()
    starts = [0] * len(lengths) if context_starts is None else context_starts.tolist()
    check_context_lens(lengths, block_tables.shape[-1] * k_cache.shape[1], starts)
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    per_head = block_tables.dim() == 3
    group = q.shape[1] // heads_kv if per_head else q.shape[1]
    for b, (start, length) in enumerate(zip(starts, lengths)):
        pos = torch.arange(start, length, device=block_tables.device)
        for h in range(heads_kv if per_head else 1):  # a table per KV head, or one for all
            table = block_tables[b, h] if per_head else block_tables[b]
            heads = slice(h * group, (h + 1) * group)
            kv_heads = slice(h, h + 1) if per_head else slice(None)
            blocks = table[pos // block_size].long()
            slots = (blocks * block_size + pos % block_size)[blocks >= 0]  # a -1 table entry reads nothing
            if not slots.numel():
                continue
            keys, values = (dequantize(cache[:, :, kv_heads].flatten(0, 1)[slots],
                                       None if sc is None else sc[:, :, kv_heads].flatten(0, 1)[slots], dtype)[None]
                            for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
            out_b, lse_b = flash_attn_with_lse_ref(q[b, heads][None, None].to(dtype), keys, values, scale, False)
            out[b, heads], lse[b, heads] = out_b[0, 0], lse_b[0, :, 0]
    return (out, lse) if return_lse else out.to(q.dtype)


@triton.jit
def _decode_tile(
    q, k_ptr, v_ptr, ks_ptr, vs_ptr, block, n0, end, m_i, l_i, acc, d, d_mask, scale_log2,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
    FP8_WORDS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One online-softmax step over the tokens n0 .. n0 + BLOCK_N - 1 (those < end); ``block``
    ``[BLOCK_N]``: each token's cache block. ``SCALED``: fp8 keys and values with per-token scales
    (``ks_ptr``, ``vs_ptr``: this KV head's), applied to the scores and probabilities
    (:func:`scaled_online_softmax_step`). ``FP8_WORDS``: the values are read with
    :func:`load_fp8_rows` (:func:`load_value_rows`)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = (pos < end) & (block >= 0)  # a -1 table entry reads nothing
    offset = pos % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    block = block.to(tl.int64)
    k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + d[None, :],
                mask=kv_mask, other=0.0)
    v = load_value_rows(v_ptr + block * stride_vb + offset * stride_vs, n_mask, d, d_mask, HEAD_DIM, BLOCK_D,
                        FP8_WORDS)
    if SCALED:  # one return at the end: Triton compiles the statements after a return in a branch
        slots = block * stride_sb + offset * stride_ss
        m_i, l_i, acc = scaled_online_softmax_step(q, k, v, tl.load(ks_ptr + slots, mask=n_mask, other=0.0),
                                                   tl.load(vs_ptr + slots, mask=n_mask, other=0.0), n_mask, m_i, l_i,
                                                   acc, scale_log2, DOT_PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _tile_blocks(table_row_ptr, n0, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The cache block of each token n0 .. n0 + BLOCK_N - 1 (0 past ``end``)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    return tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0)


@triton.jit(do_not_specialize=["stride_tb", "stride_th", "stride_lb", "stride_lh"])
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, starts_ptr, o_part_ptr, lse_part_ptr,
    scale_log2, tokens_per_split, max_tokens,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_tb, stride_th, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, G_CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr, FINAL: tl.constexpr, HAS_STARTS: tl.constexpr, SCALED: tl.constexpr,
    FP8_WORDS: tl.constexpr,
):
    """The split pass of :func:`decode_attention` (public for ``benchmarks/ptx_census.py``). One
    (sequence, GQA head chunk, split): its partial output and base-2 LSE. ``FINAL`` (one split):
    the pointers and strides are the output's and the LSE's, written as the merge writes them
    (output in its dtype, LSE in natural log), so no merge kernel runs. ``stride_th``: 0 when
    every KV head reads the sequence's one table, else the stride between the heads' tables.
    ``HAS_STARTS``: the split's tokens before the row's start (``starts_ptr``, a sliding window's
    first visible token) are skipped: its loop begins there, so blocks wholly before it are never
    read. ``SCALED``: an fp8 cache with scales ``ks_ptr``, ``vs_ptr`` (strides ``stride_s*``);
    ``FP8_WORDS``: its values are read as words (:func:`load_fp8_rows`)."""
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(0) // G_CHUNKS
    g = (tl.program_id(0) % G_CHUNKS) * BLOCK_G + tl.arange(0, BLOCK_G)
    split = tl.program_id(2)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if SCALED:
        q, scale_log2 = half_query(q, scale_log2)
    start = split * tokens_per_split
    end = tl.minimum(tl.minimum(start + tokens_per_split, tl.load(lens_ptr + b)), max_tokens)
    if HAS_STARTS:
        start = tl.maximum(start, tl.load(starts_ptr + b))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    ks_head, vs_head = ks_ptr + kv_head * stride_sh, vs_ptr + kv_head * stride_sh
    table_row = table_ptr + b * stride_tb + kv_head * stride_th
    # Each tile's block ids are loaded during the tile before it, so a tile's K/V loads do not wait
    # for its ids. Triton's interpreter (numpy 2) cannot take tensor bounds in range(); compiled
    # kernels keep the for loop, which Triton software-pipelines (the while form is slower:
    # docs/ops.md, 'Measured on the H200').
    block = _tile_blocks(table_row, start, end, BLOCK_N, BLOCK_SIZE)
    if WHILE_LOOP:
        n0 = start
        while n0 < end:
            following = _tile_blocks(table_row, n0 + BLOCK_N, end, BLOCK_N, BLOCK_SIZE)
            m_i, l_i, acc = _decode_tile(q, k_head, v_head, ks_head, vs_head, block, n0, end, m_i, l_i, acc, d,
                                         d_mask, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb,
                                         stride_ss, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, SCALED,
                                         FP8_WORDS, HEAD_DIM, BLOCK_D)
            block = following
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            following = _tile_blocks(table_row, n0 + BLOCK_N, end, BLOCK_N, BLOCK_SIZE)
            m_i, l_i, acc = _decode_tile(q, k_head, v_head, ks_head, vs_head, block, n0, end, m_i, l_i, acc, d,
                                         d_mask, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb,
                                         stride_ss, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, SCALED,
                                         FP8_WORDS, HEAD_DIM, BLOCK_D)
            block = following
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    part = b * stride_pb + heads * stride_ph + split * stride_ps
    lse = m_i + tl.log2(l_i)
    if FINAL:  # natural log, as the merge writes it (no key: -inf + log2(0) = -inf)
        lse = lse * 0.6931471805599453
    tl.store(o_part_ptr + part[:, None] + d[None, :], out.to(o_part_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh", "stride_mb"])
def _decode_reduce_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, stride_mb,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(lse_part_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=mask, other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if WRITE_LSE:
        # Base-2 LSE of the merged splits, in natural log (x ln 2); no key: -inf + log2(0) = -inf.
        tl.store(lse_ptr + b * stride_mb + h, (top + tl.log2(total)) * 0.6931471805599453)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _split_plan(programs_per_split: int, max_tokens: int, block_n: int, device, num_splits) -> tuple[int, int]:
    """(num_splits, tokens_per_split) from shapes only, so a captured CUDA graph stays valid."""
    if num_splits is None:
        sms = _sm_count(device)
        wanted = 1 if programs_per_split >= _UNSPLIT_PROGRAMS_PER_SM * sms else cdiv(_PROGRAMS_PER_SM * sms,
                                                                                   programs_per_split)
        num_splits = min(wanted, _MAX_SPLITS, max(1, max_tokens // _MIN_SPLIT_TOKENS))
    tokens_per_split = max(block_n, cdiv(cdiv(max_tokens, num_splits), block_n) * block_n)
    return max(1, cdiv(max_tokens, tokens_per_split)), tokens_per_split


def _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, return_lse, context_starts,
                   k_scale, v_scale):
    batch, heads_q, dim = q.shape
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    group = heads_q // heads_kv
    g_chunks = cdiv(group, _BLOCK_G)
    block_d = block_dim(dim)
    scaled = k_scale is not None
    block_n = split_block_n(scaled, block_d)
    max_tokens = block_tables.shape[-1] * block_size
    splits, tokens_per_split = _split_plan(batch * heads_kv * g_chunks, max_tokens, block_n, q.device, num_splits)
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    starts = lens if context_starts is None else context_starts.contiguous()  # not read without starts
    out = torch.empty((batch, heads_q, dim), dtype=torch.float32 if return_lse else q.dtype, device=q.device)
    # One split (a large batch): the split kernel writes the result itself, its LSE too (a scratch
    # row when not asked for), so that the kernel has one form per dtype.
    final = splits == 1
    if final:
        lse = torch.empty((batch, heads_q), dtype=torch.float32, device=q.device)
        o_part, lse_part = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        o_part = torch.empty((batch, heads_q, splits, dim), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((batch, heads_q, splits), dtype=torch.float32, device=q.device)
        # the merge writes the LSE only when asked; otherwise lse_part stands in, unwritten
        lse = torch.empty((batch, heads_q), dtype=torch.float32, device=q.device) if return_lse else lse_part
    k_scale, v_scale = (k_scale, v_scale) if scaled else (lens, lens)  # not read unscaled
    decode_split_kernel[(heads_kv * g_chunks, batch, splits)](
        q, k_cache, v_cache, k_scale, v_scale, tables, lens, starts, o_part, lse_part,
        scale * LOG2E, tokens_per_split, max_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(k_scale.stride()[:3] if scaled else (0, 0, 0)), tables.stride(0),
        tables.stride(1) if tables.dim() == 3 else 0,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        GROUP=group, G_CHUNKS=g_chunks, HEAD_DIM=dim, BLOCK_G=_BLOCK_G, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, WHILE_LOOP=not q.is_cuda,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FINAL=final,
        HAS_STARTS=context_starts is not None, SCALED=scaled,
        FP8_WORDS=fp8_word_loads(v_cache, dim), num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    if not final:
        _decode_reduce_kernel[(batch, heads_q)](
            o_part, lse_part, out, lse, splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            HEAD_DIM=dim, BLOCK_S=next_pow2(splits if interpreted(q) else max(splits, _MAX_SPLITS)),
            BLOCK_D=block_d, WRITE_LSE=return_lse,
        )
    return (out, lse) if return_lse else out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    return_lse: bool = False,
    context_starts: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's one new query over its paged cached context.

    Args:
        q: ``[B, Hq, D]``, float16/bfloat16/float32, ``1 <= D <= 256``; rows may be strided.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: q head
            h uses kv head ``h // (Hq // Hkv)``) and a contiguous last dim.
        block_tables: int32 ``[B, M]`` block ids, or ``[B, Hkv, M]``: a table per KV head (each KV
            head and its GQA group of q heads read their own blocks, e.g. pages chosen per head
            with the cache viewed as ``[num_pages, page_size, Hkv, D]``); entries past a sequence's
            context are not read; a -1 entry within the context reads nothing (its tokens are
            masked).
        context_lens: int32 ``[B]``, tokens to attend to (the new token included, already stored),
            ``0 <= context_lens[b] <= M * block_size``; 0 (padded rows) gives an output of zeros.
        scale: softmax scale (usually ``D ** -0.5``).
        num_splits: split-K chunks per sequence; None picks one from B, heads and M only.
        return_lse: also return the log-sum-exp, for merging with attention over other keys
            (:func:`merge_attention_outputs`).
        context_starts: int32 ``[B]`` or None: row b attends to its tokens ``context_starts[b] ..
            context_lens[b] - 1`` only (indices into its table's tokens, ``0 <= start <= length``;
            None: from 0). A sliding window's caller passes a table that begins at the window's
            first block and the window's first token in it; tokens before a start are never read.
            A row with nothing to read gives out 0 and lse -inf.
        k_scale, v_scale: float32 ``[num_blocks, block_size, Hkv]``, exactly when the caches are
            fp8 (float8_e4m3fn / float8_e5m2): a key is read as ``k.to(float32) * k_scale`` at its
            slot (``nanovllm.ops.kv_quant``), dequantized in registers; the two share strides.

    Returns:
        ``out [B, Hq, D]`` in q.dtype; with ``return_lse`` ``(out, lse)``: out float32 (the
        normalised output before any cast to q.dtype; float64 for float64 q on the reference
        path) and lse float32 ``[B, Hq]``, natural log of the sum of exp(scaled scores), -inf
        where row b reads no token (out 0 there).

    Raises:
        ValueError: inconsistent shapes, Hq not a multiple of Hkv, D outside 1..256, a
            non-contiguous cache head_dim, num_splits < 1, return_lse not a bool, context_starts
            not an int32/int64 ``[B]``, scales missing for fp8 caches or given for others; the
            reference and the CPU path also reject context lengths
            and starts out of range.

    CUDA: the two Triton kernels of this module (split-K pass, then LSE merge of the splits, which
    also writes the merged LSE when asked; with one split, e.g. a large batch, the split pass
    writes the result itself and no merge runs), with a grid fixed by the shapes and no host sync, so
    the call is CUDA-graph capturable (run it once before capture so Triton compiles); flash_attn's
    paged kernel is not used (the comparison with cuDNN over contiguous KV: docs/ops.md, 'Measured
    on the H200'). With ``context_starts`` each split's loop begins at the row's start (a variant
    of the split kernel compiled for it; without starts the kernel is unchanged). Lengths and
    starts are not range-checked on the device. CPU: the whole batch in one call of torch's fused
    CPU flash attention (:func:`nanovllm.ops.decode_cpu.decode_cpu`), range-checked; without
    Triton on another device: :func:`decode_attention_ref`.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, context_starts, k_scale, v_scale)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if return_lse not in (True, False):
        raise ValueError(f"return_lse={return_lse!r} must be a bool")
    return_lse = bool(return_lse)
    if q.shape[0] and use_triton(q):
        return _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, return_lse,
                              context_starts, k_scale, v_scale)
    if q.device.type == "cpu":
        return decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse, context_starts,
                          k_scale, v_scale)
    return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse, context_starts,
                                k_scale, v_scale)
