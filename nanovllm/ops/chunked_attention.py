"""Attention over one chunk of keys with its log-sum-exp, and the LSE merge of partial results.

Chunked prefill, prefix caching and CPU offload all attend to the keys in pieces and combine the
pieces exactly: with ``lse = log(sum(exp(scores)))`` per query row, two partial outputs over
disjoint key sets merge into the output over their union (the rescaling of FlashAttention-2's
online softmax, Dao 2023, applied across chunks as in Flash-Decoding's split-K reduction).
"""

import logging

import torch

from ._triton import check_gqa, check_head_dim, next_pow2
from .backend import tl, triton, use_triton

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
_failed_backends: set = set()
"""(backend name, dtype, head_dim) keys whose torch SDPA kernel raised once; not retried."""


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"expected q [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D] of one shape; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k differ in batch or head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    check_gqa(q.shape[2], k.shape[2])
    check_head_dim(q.shape[3])


def _empty_rows_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_q, heads, _ = q.shape
    lse = torch.full((batch, heads, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def flash_attn_with_lse_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-math reference of :func:`flash_attn_with_lse` (same arguments and results).

    Computes in float32 (float64 inputs stay float64); rows that see no key give out 0, lse -inf.
    """
    _check_qkv(q, k, v)
    batch, seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dtype).reshape(batch, seq_q, heads_kv, heads_q // heads_kv, dim).permute(0, 2, 3, 1, 4)
    kf = k.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)
    scores = (qf @ kf.transpose(-1, -2)) * softmax_scale
    if causal:
        q_pos = torch.arange(seq_q, device=q.device) + (seq_k - seq_q)
        hidden = torch.arange(seq_k, device=q.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = (probs @ vf).permute(0, 3, 1, 2, 4).reshape(batch, seq_q, heads_q, dim)
    return out.to(q.dtype), lse.reshape(batch, heads_q, seq_q).float()


def _cudnn(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse.reshape(q.shape[:3])


def _repeat_kv(q, k, v):
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _flash(q, k, v, scale, causal):
    k, v = _repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse


def _efficient(q, k, v, scale, causal):
    k, v = _repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]


_SDPA_BACKENDS = (("cudnn", _cudnn, _HALF), ("flash", _flash, _HALF), ("efficient", _efficient, None))
"""torch's fused CUDA kernels in order of preference, with the dtypes each accepts (None: any)."""


def _sdpa_with_lse(q, k, v, scale, causal):
    """First torch fused kernel that accepts the inputs (q/k/v in [B, S, H, D]), else the reference."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for name, backend, dtypes in _SDPA_BACKENDS:
        key = (name, q.dtype, q.shape[-1])
        if (dtypes is not None and q.dtype not in dtypes) or key in _failed_backends:
            continue
        try:
            out, lse = backend(qt, kt, vt, scale, causal)
        except RuntimeError as err:
            _failed_backends.add(key)
            logger.warning("SDPA backend %s unavailable for %s head_dim %d: %s", name, q.dtype, q.shape[-1], err)
            continue
        return out.transpose(1, 2).to(q.dtype), lse.float()
    return flash_attn_with_lse_ref(q, k, v, scale, causal)


def _cpu_sdpa_with_lse(q, k, v, scale, causal):
    """torch's fused CPU flash attention (it returns the LSE); k/v heads are expanded for GQA,
    acceptable off the GPU hot path."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kt, vt = _repeat_kv(qt, kt, vt)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=scale)[:2]
    return out.transpose(1, 2), lse.float()


def flash_attn_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one chunk of keys, returning the output and its log-sum-exp.

    Args:
        q: ``[B, Sq, Hq, D]``; k, v: ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: q head h
            uses kv head ``h // (Hq // Hkv)``), ``1 <= D <= 256``, float16/bfloat16/float32.
        softmax_scale: multiplies q.k before the softmax (usually ``D ** -0.5``).
        causal: bottom-right aligned mask; query i sits at key position ``Sk - Sq + i``.

    Returns:
        ``(out [B, Sq, Hq, D] in q.dtype, lse float32 [B, Hq, Sq])``, lse in natural log of the
        sum of exp(scaled scores). Rows that see no key (causal with Sq > Sk, or Sk == 0) give
        out 0 and lse -inf.

    Raises:
        ValueError: shapes that disagree, Hq not a multiple of Hkv, or D outside 1..256.

    CUDA: torch's cuDNN attention (fp16/bf16, native GQA; the optional flash_attn package is not
    used, docs/ops.md 'Conventions' says why), then torch's flash /
    memory-efficient kernels (a kernel that raises is logged and skipped from then on), else the
    reference. Causal with Sq < Sk is split into a non-causal prefix and a causal square, merged
    by LSE, because torch's kernels align the causal mask top-left. CPU: torch's fused CPU flash
    attention the same way. One query row, or float64: :func:`flash_attn_with_lse_ref`.
    """
    _check_qkv(q, k, v)
    seq_q, seq_k = q.shape[1], k.shape[1]
    if (causal and seq_q > seq_k) or seq_q == 1 or q.dtype == torch.float64:
        # One query row (decode): a few small kernels, and no per-shape cuDNN plan to build
        # for every new key length.
        return flash_attn_with_lse_ref(q, k, v, softmax_scale, causal)
    if seq_q == 0 or seq_k == 0:
        return _empty_rows_result(q)
    sdpa = _sdpa_with_lse if q.is_cuda else _cpu_sdpa_with_lse
    if causal and seq_q < seq_k:
        prefix = seq_k - seq_q
        o1, lse1 = sdpa(q, k[:, :prefix], v[:, :prefix], softmax_scale, False)
        o2, lse2 = sdpa(q, k[:, prefix:], v[:, prefix:], softmax_scale, True)
        return merge_attention_outputs(o1, lse1, o2, lse2)
    return sdpa(q, k, v, softmax_scale, causal)


def _check_merge(o1, lse1, o2, lse2) -> None:
    if o1.dim() != 4 or o1.shape != o2.shape:
        raise ValueError(
            f"o1 and o2 must both be [B, S, H, D]; got {tuple(o1.shape)} and {tuple(o2.shape)}"
        )
    batch, seq, heads, dim = o1.shape
    if lse1.shape != (batch, heads, seq) or lse2.shape != (batch, heads, seq):
        raise ValueError(
            f"lse1 and lse2 must be [B, H, S] = {(batch, heads, seq)}; got {tuple(lse1.shape)} "
            f"and {tuple(lse2.shape)}"
        )
    check_head_dim(dim)


def merge_attention_outputs_ref(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`merge_attention_outputs` (same arguments and results)."""
    _check_merge(o1, lse1, o2, lse2)
    dtype = torch.promote_types(o1.dtype, torch.float32)
    lse1, lse2 = lse1.to(dtype), lse2.to(dtype)
    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isneginf(top), 0.0, top)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    lse = top + torch.log(total)
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    c1 = (w1 * inv).transpose(1, 2).unsqueeze(-1)
    c2 = (w2 * inv).transpose(1, 2).unsqueeze(-1)
    empty1 = torch.isneginf(lse1).transpose(1, 2).unsqueeze(-1)
    empty2 = torch.isneginf(lse2).transpose(1, 2).unsqueeze(-1)
    out = torch.where(empty1, 0.0, o1.to(dtype) * c1) + torch.where(empty2, 0.0, o2.to(dtype) * c2)
    return out.to(o1.dtype), lse.float()


@triton.jit(do_not_specialize=["seq_len", "stride_lb", "stride_lh"])
def _merge_kernel(
    o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, out_ptr, lse_ptr, seq_len,
    stride_o1b, stride_o1s, stride_o1h, stride_o2b, stride_o2s, stride_o2h,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // seq_len
    s = row % seq_len
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < NUM_HEADS
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    lse_off = b * stride_lb + h * stride_lh + s
    lse1 = tl.load(lse1_ptr + lse_off, mask=h_mask, other=float("-inf"))
    lse2 = tl.load(lse2_ptr + lse_off, mask=h_mask, other=float("-inf"))
    top = tl.maximum(lse1, lse2)
    top = tl.where(top == float("-inf"), 0.0, top)
    w1 = tl.exp(lse1 - top)
    w2 = tl.exp(lse2 - top)
    total = w1 + w2
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    c1 = (w1 * inv)[:, None]
    c2 = (w2 * inv)[:, None]
    o1 = tl.load(o1_ptr + b * stride_o1b + s * stride_o1s + h[:, None] * stride_o1h + d[None, :], mask=mask)
    o2 = tl.load(o2_ptr + b * stride_o2b + s * stride_o2s + h[:, None] * stride_o2h + d[None, :], mask=mask)
    empty1 = (lse1 == float("-inf"))[:, None]  # an empty side adds nothing, even NaN garbage; a NaN lse propagates
    empty2 = (lse2 == float("-inf"))[:, None]
    out = tl.where(empty1, 0.0, o1.to(tl.float32) * c1) + tl.where(empty2, 0.0, o2.to(tl.float32) * c2)
    out_off = b * stride_ob + s * stride_os + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + lse_off, top + tl.log(total), mask=h_mask)


def merge_attention_outputs(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention outputs over disjoint key sets into the output over their union.

    Args:
        o1, o2: ``[B, S, H, D]`` partial outputs (any float dtype, strided rows allowed).
        lse1, lse2: ``[B, H, S]`` their log-sum-exps (natural log; float32 preferred).

    Returns:
        ``(o [B, S, H, D] in o1.dtype, lse float32 [B, H, S])`` with ``m = max(lse1, lse2)``,
        ``o = (o1 e^(lse1-m) + o2 e^(lse2-m)) / (e^(lse1-m) + e^(lse2-m))``, ``lse = m + log(sum)``.
        A side with lse -inf contributes nothing (the other side comes back exactly, even if the
        -inf side holds NaN); both -inf give o 0 and lse -inf; never NaN from -inf inputs. A NaN
        lse, or NaN in the o of a side that is not empty, gives NaN (it is never dropped).

    Raises:
        ValueError: o1/o2 shapes differ, lse shapes are not [B, H, S], or D outside 1..256.

    CUDA: one fused Triton pass (one program per (b, s) row, all heads, fp32 math);
    CPU: :func:`merge_attention_outputs_ref`.
    """
    _check_merge(o1, lse1, o2, lse2)
    if not use_triton(o1):
        return merge_attention_outputs_ref(o1, lse1, o2, lse2)
    batch, seq, heads, dim = o1.shape
    o1 = o1 if o1.stride(-1) == 1 else o1.contiguous()
    o2 = o2 if o2.stride(-1) == 1 else o2.contiguous()
    lse1, lse2 = lse1.float().contiguous(), lse2.float().contiguous()
    out = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    lse = torch.empty_like(lse1)
    if out.numel() == 0:
        return out, lse
    _merge_kernel[(batch * seq,)](
        o1, lse1, o2, lse2, out, lse, seq,
        o1.stride(0), o1.stride(1), o1.stride(2), o2.stride(0), o2.stride(1), o2.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim),
    )
    return out, lse
