"""One decode query over one chunk of keys, folded into a running attention state in place.

Offload-mode decode reads a sequence's KV block by block through the GPU ring buffer. Instead of
computing each block's partial output and LSE and then merging them (three or more launches and
two temporaries per block), one kernel per block runs FlashAttention-2's online softmax over the
block (Dao, 2023) and folds the result into the running ``(out, lse)`` state with the
log-sum-exp rescaling of Flash-Decoding's split-K reduction. The host work per block is one
launch, which keeps the host ahead of the copy engine; a fold with few programs over many keys
(batch-1 decode of a few KV heads) splits its keys like Flash-Decoding and merges the parts with
a second launch.
"""

import torch

from nanovllm.utils.ints import cdiv

from ._triton import (LOG2E, MIN_DOT_ROWS, block_dim, check_gqa, check_head_dim, fp8_word_loads, half_query,
                      load_value_rows, next_pow2, online_softmax_step, scaled_online_softmax_step)
from .backend import tl, triton, use_triton
from .chunked_attention import flash_attn_with_lse_ref, merge_attention_outputs_ref
from .kv_quant import check_scales, dequantize

_BLOCK_G = MIN_DOT_ROWS
"""q heads per program (a GQA group, padded)."""
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2
_SPLIT_BELOW_PROGRAMS = 32
"""A fold whose (kv head, q-head chunk) programs are fewer than this splits its keys..."""
_MIN_SPLIT_KEYS = 256
"""... into about this many keys a part or more (the keys must be at least two parts' worth) ..."""
_SPLIT_PROGRAMS = 128
"""... aiming at this many programs (a batch-1 fold of one large block by a model with few KV
heads, e.g. the fixed host block on QUEST's per-layer chain, is otherwise a handful of programs:
docs/ops.md, 'decode_merge.py')..."""
_MAX_SPLITS = 32
"""... and at most this many parts."""


def _check_args(q, k, v, out, lse, k_scale=None, v_scale=None) -> None:
    if q.dim() != 2 or k.dim() != 3 or k.shape != v.shape or q.shape[1] != k.shape[2]:
        raise ValueError(f"expected q [Hq, D] and k, v [Sk, Hkv, D] with one D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_gqa(q.shape[0], k.shape[1])
    check_head_dim(q.shape[1])
    if out.shape != q.shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(q.shape)}; got {out.dtype} {tuple(out.shape)}")
    if lse.shape != (q.shape[0],) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [{q.shape[0]}]; got {lse.dtype} {tuple(lse.shape)}")
    check_scales(k, k_scale, "k_scale")
    check_scales(v, v_scale, "v_scale")


def decode_attend_merge_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, softmax_scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> None:
    """Reference of :func:`decode_attend_merge` (same arguments and effect): fp8 keys and values
    dequantized to q's dtype, attention through :func:`flash_attn_with_lse_ref`, then
    :func:`merge_attention_outputs_ref`."""
    _check_args(q, k, v, out, lse, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
    o_blk, lse_blk = flash_attn_with_lse_ref(q[None, None], k[None], v[None], softmax_scale, False)
    merged, merged_lse = merge_attention_outputs_ref(out[None, None], lse[None, :, None],
                                                     o_blk.float(), lse_blk)
    out.copy_(merged[0, 0])
    lse.copy_(merged_lse[0, :, 0])


@triton.jit
def _tile(q, k_head, v_head, ks_head, vs_head, n0, num_keys, m_i, l_i, acc, d, d_mask, scale_log2, stride_kn,
          stride_vn, stride_sn, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
          FP8_WORDS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N - 1 (those < num_keys); ``SCALED``:
    fp8 keys and values with per-token scales (this KV head's), applied to the scores and
    probabilities (:func:`scaled_online_softmax_step`); ``FP8_WORDS``: the values are read with
    :func:`load_fp8_rows` (:func:`load_value_rows`)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < num_keys
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + n[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
    v = load_value_rows(v_head + n * stride_vn, n_mask, d, d_mask, HEAD_DIM, BLOCK_D, FP8_WORDS)
    if SCALED:  # one return at the end: Triton compiles the statements after a return in a branch
        m_i, l_i, acc = scaled_online_softmax_step(q, k, v, tl.load(ks_head + n * stride_sn, mask=n_mask, other=0.0),
                                                   tl.load(vs_head + n * stride_sn, mask=n_mask, other=0.0), n_mask,
                                                   m_i, l_i, acc, scale_log2, DOT_PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_keys", "keys_per_split"])
def _decode_attend_merge_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, num_keys, keys_per_split,
    scale_log2, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh, stride_oh, stride_ph,
    stride_ps, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr, SPLIT: tl.constexpr,
    SCALED: tl.constexpr, FP8_WORDS: tl.constexpr,
):
    """Program (kv head, q-head chunk, part): online softmax over the part's keys; unsplit (one
    part) folded into ``(out, lse)`` here, split written to the part buffers for
    :func:`_fold_parts_kernel`. ``FP8_WORDS``: fp8 values read as words (:func:`load_fp8_rows`)."""
    kv_head = tl.program_id(0)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    part = tl.program_id(2)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = g < GROUP, d < HEAD_DIM
    q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if SCALED:
        q, scale_log2 = half_query(q, scale_log2)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    ks_head, vs_head = ks_ptr + kv_head * stride_sh, vs_ptr + kv_head * stride_sh
    start = part * keys_per_split
    end = tl.minimum(start + keys_per_split, num_keys)
    # The interpreter cannot take a tensor bound in range(); compiled kernels keep the for loop.
    if WHILE_LOOP:
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _tile(q, k_head, v_head, ks_head, vs_head, n0, end, m_i, l_i, acc, d, d_mask,
                                  scale_log2, stride_kn, stride_vn, stride_sn, BLOCK_N, DOT_PRECISION, SCALED,
                                  FP8_WORDS, HEAD_DIM, BLOCK_D)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _tile(q, k_head, v_head, ks_head, vs_head, n0, end, m_i, l_i, acc, d, d_mask,
                                  scale_log2, stride_kn, stride_vn, stride_sn, BLOCK_N, DOT_PRECISION, SCALED,
                                  FP8_WORDS, HEAD_DIM, BLOCK_D)
    # every part has >= 1 key, so lse_blk is finite
    lse_blk = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        parts = part_o_ptr + heads[:, None] * stride_ph + part * stride_ps + d[None, :]
        tl.store(parts, acc / l_i[:, None], mask=o_mask)
        tl.store(part_lse_ptr + heads * tl.num_programs(2) + part, lse_blk, mask=g_mask)
    else:  # fold (acc / l_i, lse_blk) into the running state
        lse_old = tl.load(lse_ptr + heads, mask=g_mask, other=float("-inf"))
        lse_new = tl.maximum(lse_old, lse_blk) + tl.log(1.0 + tl.exp(-tl.abs(lse_old - lse_blk)))
        w_old = tl.exp(lse_old - lse_new)
        w_blk = tl.exp(lse_blk - lse_new) / l_i
        o_ptrs = out_ptr + heads[:, None] * stride_oh + d[None, :]
        o_old = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(o_ptrs, o_old * w_old[:, None] + acc * w_blk[:, None], mask=o_mask)
        tl.store(lse_ptr + heads, lse_new, mask=g_mask)


@triton.jit
def _fold_parts_kernel(out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, num_parts, stride_oh, stride_ph, stride_ps,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program h: head h's parts and its running state, merged by LSE (a fixed reduction, so the
    result does not depend on the order the parts were written in)."""
    h = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask, d_mask = s < num_parts, d < HEAD_DIM
    lse_parts = tl.load(part_lse_ptr + h * num_parts + s, mask=s_mask, other=float("-inf"))
    lse_old = tl.load(lse_ptr + h)
    top = tl.maximum(tl.max(lse_parts, 0), lse_old)  # finite: every part has keys
    w_parts = tl.exp(lse_parts - top)
    w_old = tl.exp(lse_old - top)
    total = tl.sum(w_parts, 0) + w_old
    o_parts = tl.load(part_o_ptr + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o_old = tl.load(out_ptr + h * stride_oh + d, mask=d_mask, other=0.0)
    merged = (tl.sum(o_parts * w_parts[:, None], 0) + o_old * w_old) / total
    tl.store(out_ptr + h * stride_oh + d, merged, mask=d_mask)
    tl.store(lse_ptr + h, top + tl.log(total))


def _split_plan(programs: int, num_keys: int, block_n: int) -> tuple[int, int]:
    """(parts, keys per part) of a fold: one part when the programs fill enough of the GPU or the
    keys are few; else parts of a multiple of ``block_n`` keys (see :data:`_SPLIT_PROGRAMS`)."""
    if programs >= _SPLIT_BELOW_PROGRAMS or num_keys < 2 * _MIN_SPLIT_KEYS:
        return 1, num_keys
    parts = min(cdiv(_SPLIT_PROGRAMS, programs), _MAX_SPLITS, num_keys // _MIN_SPLIT_KEYS)
    keys_per_split = cdiv(cdiv(num_keys, parts), block_n) * block_n
    return cdiv(num_keys, keys_per_split), keys_per_split


def decode_attend_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, softmax_scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """Fold attention of one query over one chunk of keys into a running state, in place.

    After the call ``(out, lse)`` is the attention state over the keys seen before plus ``k``:
    ``lse' = log(exp(lse) + exp(lse_chunk))`` and ``out' = out * exp(lse - lse') + out_chunk *
    exp(lse_chunk - lse')`` (the LSE merge of :func:`merge_attention_outputs`). Start from
    ``out = 0`` and ``lse = -inf`` (no keys yet).

    Args:
        q: ``[Hq, D]``, the query of one sequence, float16/bfloat16/float32, ``1 <= D <= 256``.
        k, v: ``[Sk, Hkv, D]`` (token rows may be strided, head_dim contiguous), ``Hq % Hkv == 0``
            (GQA: q head h uses kv head ``h // (Hq // Hkv)``), q's dtype. ``Sk == 0`` is a no-op.
        out: float32 ``[Hq, D]``, the running normalised output (updated in place).
        lse: float32 ``[Hq]``, its natural-log log-sum-exp (updated in place; -inf = empty).
        softmax_scale: multiplies q.k before the softmax.
        k_scale, v_scale: float32 ``[Sk, Hkv]``, exactly when k and v are fp8 (float8_e4m3fn /
            float8_e5m2, then not q's dtype): a key is read as ``k.to(float32) * k_scale``
            (``nanovllm.ops.kv_quant``), in registers.

    Raises:
        ValueError: shapes or dtypes that disagree, Hq not a multiple of Hkv, D outside 1..256,
            scales missing for fp8 keys and values or given for others.

    CUDA: one Triton launch, a program per (kv head, 16 q heads of its group), 64-key tiles; when
    those programs are few (under 32) and the keys many (512 or more), the keys are split into parts
    (up to 32, aiming at 128 programs; docs/ops.md, 'decode_merge.py', says what it gains) and a
    second launch merges the parts into the state (a fixed reduction: deterministic). CPU:
    :func:`decode_attend_merge_ref` (or the kernels under the Triton interpreter).
    """
    _check_args(q, k, v, out, lse, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    if q.dtype == torch.float64 or not use_triton(q):
        decode_attend_merge_ref(q, k, v, out, lse, softmax_scale, k_scale, v_scale)
        return
    heads_q, dim = q.shape
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scaled = k_scale is not None
    if scaled and k_scale.stride() != v_scale.stride():
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    k_scale, v_scale = (k_scale, v_scale) if scaled else (lse, lse)  # not read unscaled
    block_d = block_dim(dim)
    block_n = _BLOCK_N if block_d <= 128 else _BLOCK_N // 2
    g_chunks = cdiv(group, _BLOCK_G)
    parts, keys_per_split = _split_plan(heads_kv * g_chunks, k.shape[0], block_n)
    split = parts > 1
    if split:
        part_o = torch.empty((heads_q, parts, dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((heads_q, parts), dtype=torch.float32, device=q.device)
    else:  # one part: the kernel folds into (out, lse) itself and never touches the part buffers
        part_o, part_lse = out[:, None], lse
    _decode_attend_merge_kernel[(heads_kv, g_chunks, parts)](
        q, k, v, k_scale, v_scale, out, lse, part_o, part_lse, k.shape[0], keys_per_split, softmax_scale * LOG2E,
        q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *(k_scale.stride() if scaled else (0, 0)),
        out.stride(0), part_o.stride(0), part_o.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_G=_BLOCK_G, BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOP=not q.is_cuda, SPLIT=split,
        SCALED=scaled, FP8_WORDS=fp8_word_loads(v, dim), num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    if split:
        _fold_parts_kernel[(heads_q,)](
            out, lse, part_o, part_lse, parts, out.stride(0), part_o.stride(0), part_o.stride(1),
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=next_pow2(_MAX_SPLITS) if q.is_cuda else next_pow2(parts),
        )
