"""Rotary position embedding (Su et al., RoFormer 2021) of q and k in one launch, optionally
after Qwen3's per-head RMSNorm of q and k (the same launch).

The rotation uses the "rotate half" layout of Llama/Qwen checkpoints: with ``x = [x1, x2]``
split in halves of the head dimension, ``x' = [x1 cos - x2 sin, x2 cos + x1 sin]``, computed in
float32 from a float32 cos/sin table and rounded once to the input dtype. The optional norm is
:func:`nanovllm.ops.rms_norm_ref`'s per head, with its roundings (normalised row, then weight),
so that the fused launch computes what an RMSNorm launch followed by a RoPE launch computes (up
to the order of the mean square's float32 sum).
"""

import torch

from ._triton import next_pow2, tl, triton, use_triton
from .rmsnorm import rms_norm, rms_norm_ref

QKNorm = tuple[torch.Tensor, torch.Tensor, float]
"""Per-head RMSNorm of q and k before the rotation: ``(q weight [D], k weight [D], eps)``."""


def _check_args(positions, q, k, cos_sin_cache, qk_norm: QKNorm | None = None) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [N, Hq, D] and k [N, Hkv, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [N={q.shape[0]}]; got {tuple(positions.shape)}")
    if q.shape[2] % 2 or cos_sin_cache.dim() != 3 or cos_sin_cache.shape[::2] != (2, q.shape[2] // 2):
        raise ValueError(f"expected an even head_dim and cos_sin_cache [2, max_position, D/2]; got D={q.shape[2]}, "
                         f"cache {tuple(cos_sin_cache.shape)}")
    if qk_norm is not None:
        q_weight, k_weight, _ = qk_norm
        if q_weight.shape != (q.shape[2],) or k_weight.shape != (q.shape[2],):
            raise ValueError(f"qk_norm weights must be [D={q.shape[2]}]; got {tuple(q_weight.shape)} and "
                             f"{tuple(k_weight.shape)}")


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`apply_rotary` (same arguments and results)."""
    _check_args(positions, q, k, cos_sin_cache, qk_norm)
    if qk_norm is not None:
        q, k = rms_norm_ref(q, qk_norm[0], qk_norm[2]), rms_norm_ref(k, qk_norm[1], qk_norm[2])
    cos, sin = cos_sin_cache[:, positions].unsqueeze(-2)
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


def _rotary_torch(positions, q, k, cos_sin_cache):
    """:func:`apply_rotary_ref`'s result, bit for bit, in 4 torch ops per tensor (plus 4 for the
    table rows) instead of 7: ``x' = x * [cos, cos] + [x2, x1] * [-sin, sin]`` (with
    ``x2 * -sin == -(x2 * sin)`` exactly, so ``x1 cos + x2 (-sin)`` rounds as ``x1 cos - x2 sin``)."""
    cos, sin = cos_sin_cache[:, positions].unsqueeze(-2)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    return tuple(_rotate_full(x, cos, sin) for x in (q, k))


def _rotate_full(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    xf, swapped = x.float(), torch.cat((x2, x1), dim=-1).float()
    return (xf * cos + swapped * sin).to(x.dtype)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, w_ptr, t, num_heads, stride_t, stride_h, cos, sin, half, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < half)[None, :]
    src = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # rms_norm's roundings: the normalised row, then times the weight
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
        x1f = (w1 * (x1f * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        x2f = (w2 * (x2f * inv_rms).to(x2.dtype).to(tl.float32)).to(x2.dtype).to(tl.float32)
    dst = out_ptr + t * num_heads * 2 * half + h[:, None] * 2 * half + d[None, :]
    tl.store(dst, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, heads_q, heads_kv, half, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache_kind, stride_cache_pos,
    NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    row = cache_ptr + pos * stride_cache_pos + d
    cos = tl.load(row, mask=d < half, other=0.0)[None, :]
    sin = tl.load(row + stride_cache_kind, mask=d < half, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, qw_ptr, t, heads_q, stride_qt, stride_qh, cos, sin, half, eps,
                  NORM, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, kw_ptr, t, heads_kv, stride_kt, stride_kh, cos, sin, half, eps,
                  NORM, BLOCK_HK, BLOCK_D)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k at ``positions``, after the per-head RMSNorm ``qk_norm`` when given.

    Args:
        positions: int64 ``[N]`` absolute positions, each below ``max_position``.
        q: ``[N, Hq, D]``; k: ``[N, Hkv, D]`` (token and head strides free, D contiguous, D even);
            float16/bfloat16/float32.
        cos_sin_cache: float32 ``[2, max_position, D/2]``: cos and sin of ``position * inv_freq``.
        qk_norm: ``(q weight [D], k weight [D], eps)`` in q's dtype: Qwen3's ``q_norm`` /
            ``k_norm`` (:func:`nanovllm.ops.rms_norm` of every head) applied first.

    Returns:
        ``(q', k')``, contiguous, in the input dtypes.

    Raises:
        ValueError: shapes that disagree, an odd head_dim, norm weights that are not ``[D]``.
        Positions are not range-checked on the device.

    CUDA: one Triton program per token normalises (optionally) and rotates all of its q and k
    heads. CPU (and strided inputs): :func:`nanovllm.ops.rms_norm` of q and k, then
    :func:`_rotary_torch`, bit for bit the reference's rotation in fewer torch ops.
    """
    _check_args(positions, q, k, cos_sin_cache, qk_norm)
    if not use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        return _rotary_torch(positions, q, k, cos_sin_cache)
    tokens, heads_q, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unread without NORM
    if tokens:
        _rotary_kernel[(tokens,)](
            positions, q, k, cos_sin_cache, q_out, k_out, q_weight, k_weight, heads_q, k.shape[1], dim // 2, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
            NORM=qk_norm is not None, BLOCK_HQ=next_pow2(heads_q), BLOCK_HK=next_pow2(k.shape[1]),
            BLOCK_D=next_pow2(dim // 2), num_warps=4,
        )
    return q_out, k_out
