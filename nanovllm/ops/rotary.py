"""Rotary position embedding (Su et al., RoFormer 2021) of q and k in one launch, optionally
after Qwen3's per-head RMSNorm of q and k (the same launch).

The rotation uses the "rotate half" layout of Llama/Qwen checkpoints: with ``x = [x1, x2]``
split in halves of the head dimension, ``x' = [x1 cos - x2 sin, x2 cos + x1 sin]``, computed in
float32 from a float32 cos/sin table and rounded once to the input dtype. The optional norm is
:func:`nanovllm.ops.rms_norm_ref`'s per head, with its roundings (normalised row, then weight),
so that the fused launch computes what an RMSNorm launch followed by a RoPE launch computes (up
to the order of the mean square's float32 sum).

With ``kv_store`` the same launch also writes the rotated keys and the values into their slots of
the paged KV cache, as :func:`nanovllm.ops.store_kvcache` writes them: a decode step then runs one
launch per layer instead of two between the qkv projection and attention.
"""

from typing import NamedTuple

import torch

from ._triton import next_pow2, tl, triton, use_triton
from .rmsnorm import rms_norm, rms_norm_ref
from .store_kv import check_store_args, store_kvcache, store_kvcache_ref

QKNorm = tuple[torch.Tensor, torch.Tensor, float]
"""Per-head RMSNorm of q and k before the rotation: ``(q weight [D], k weight [D], eps)``."""


class KVStore(NamedTuple):
    """Where :func:`apply_rotary` also writes the rotated keys and the values (the arguments of
    :func:`nanovllm.ops.store_kvcache` but the keys): ``value [N, Hkv, D]``, ``k_cache`` and
    ``v_cache [num_blocks, block_size, Hkv, D]``, ``slot_mapping`` int32/int64 ``[N]`` (-1 skips a
    token)."""

    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def _check_args(positions, q, k, cos_sin_cache, qk_norm: QKNorm | None = None,
                kv_store: KVStore | None = None) -> None:
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
    if kv_store is not None:
        if not isinstance(kv_store, KVStore):
            raise ValueError(f"kv_store must be a KVStore(value, k_cache, v_cache, slot_mapping); got "
                             f"{type(kv_store).__name__}")
        check_store_args(k, *kv_store)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     qk_norm: QKNorm | None = None, kv_store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`apply_rotary` (same arguments and results; the store through
    :func:`nanovllm.ops.store_kvcache_ref`)."""
    _check_args(positions, q, k, cos_sin_cache, qk_norm, kv_store)
    if qk_norm is not None:
        q, k = rms_norm_ref(q, qk_norm[0], qk_norm[2]), rms_norm_ref(k, qk_norm[1], qk_norm[2])
    cos, sin = cos_sin_cache[:, positions].unsqueeze(-2)
    q, k = _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)
    if kv_store is not None:
        store_kvcache_ref(k, *kv_store)
    return q, k


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
def _rotate_heads(x_ptr, w_ptr, t, num_heads, stride_t, stride_h, cos, sin, half, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's heads of x, normalised (NORM) and rotated: the two halves ``[BLOCK_H, BLOCK_D]``,
    rounded to x's dtype, and their mask."""
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
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype), mask


@triton.jit
def _store_halves(dst_ptr, stride_h, y1, y2, half, mask, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the halves ``[BLOCK_H, BLOCK_D]`` of rows ``dst_ptr + h * stride_h`` (cast to the
    destination's dtype)."""
    dst = dst_ptr + tl.arange(0, BLOCK_H)[:, None] * stride_h + tl.arange(0, BLOCK_D)[None, :]
    tl.store(dst, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_cb", "stride_vcb"])
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, heads_q, heads_kv, half, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache_kind, stride_cache_pos,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NORM: tl.constexpr, STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    row = cache_ptr + pos * stride_cache_pos + d
    cos = tl.load(row, mask=d < half, other=0.0)[None, :]
    sin = tl.load(row + stride_cache_kind, mask=d < half, other=0.0)[None, :]
    q1, q2, q_mask = _rotate_heads(q_ptr, qw_ptr, t, heads_q, stride_qt, stride_qh, cos, sin, half, eps,
                                   NORM, BLOCK_HQ, BLOCK_D)
    _store_halves(q_out_ptr + t * heads_q * 2 * half, 2 * half, q1, q2, half, q_mask, BLOCK_HQ, BLOCK_D)
    k1, k2, k_mask = _rotate_heads(k_ptr, kw_ptr, t, heads_kv, stride_kt, stride_kh, cos, sin, half, eps,
                                   NORM, BLOCK_HK, BLOCK_D)
    _store_halves(k_out_ptr + t * heads_kv * 2 * half, 2 * half, k1, k2, half, k_mask, BLOCK_HK, BLOCK_D)
    if STORE:  # store_kvcache's writes: the rotated key and the value into the token's slot
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            _store_halves(k_cache_ptr + block * stride_cb + offset * stride_cs, stride_ch, k1, k2, half, k_mask,
                          BLOCK_HK, BLOCK_D)
            src = v_ptr + t * stride_vt + tl.arange(0, BLOCK_HK)[:, None] * stride_vh + d[None, :]
            v1 = tl.load(src, mask=k_mask, other=0.0)
            v2 = tl.load(src + half, mask=k_mask, other=0.0)
            _store_halves(v_cache_ptr + block * stride_vcb + offset * stride_vcs, stride_vch, v1, v2, half, k_mask,
                          BLOCK_HK, BLOCK_D)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 qk_norm: QKNorm | None = None, kv_store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k at ``positions``, after the per-head RMSNorm ``qk_norm`` when given; with
    ``kv_store``, the rotated keys and the values also go into the paged KV cache.

    Args:
        positions: int64 ``[N]`` absolute positions, each below ``max_position``.
        q: ``[N, Hq, D]``; k: ``[N, Hkv, D]`` (token and head strides free, D contiguous, D even);
            float16/bfloat16/float32.
        cos_sin_cache: float32 ``[2, max_position, D/2]``: cos and sin of ``position * inv_freq``.
        qk_norm: ``(q weight [D], k weight [D], eps)`` in q's dtype: Qwen3's ``q_norm`` /
            ``k_norm`` (:func:`nanovllm.ops.rms_norm` of every head) applied first.
        kv_store: :class:`KVStore`: the values and the cache slots that
            :func:`nanovllm.ops.store_kvcache` would take; the rotated keys (in the cache's dtype)
            and the values are written there, in place.

    Returns:
        ``(q', k')``, contiguous, in the input dtypes.

    Raises:
        ValueError: shapes that disagree, an odd head_dim, norm weights that are not ``[D]``, a
            ``kv_store`` that is not a :class:`KVStore` or that :func:`nanovllm.ops.store_kvcache`
            would reject. Positions and slots are not range-checked on the device.

    CUDA: one Triton program per token normalises (optionally) and rotates all of its q and k
    heads, and stores its key and value rows. CPU (and strided inputs): :func:`nanovllm.ops.rms_norm`
    of q and k, then :func:`_rotary_torch`, bit for bit the reference's rotation in fewer torch ops,
    then :func:`nanovllm.ops.store_kvcache`.
    """
    _check_args(positions, q, k, cos_sin_cache, qk_norm, kv_store)
    if not use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1 or (
            kv_store is not None and kv_store.value.stride(-1) != 1):
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        q, k = _rotary_torch(positions, q, k, cos_sin_cache)
        if kv_store is not None:
            store_kvcache(k, *kv_store)
        return q, k
    tokens, heads_q, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unread without NORM
    # without a store, k stands in for the value and k_out for the caches and slots (unread)
    v, k_cache, v_cache, slots = kv_store if kv_store is not None else (k, k_out[None], k_out[None], positions)
    if tokens:
        _rotary_kernel[(tokens,)](
            positions, q, k, cos_sin_cache, q_out, k_out, q_weight, k_weight, heads_q, k.shape[1], dim // 2, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
            v, k_cache, v_cache, slots.contiguous(), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), NORM=qk_norm is not None, STORE=kv_store is not None,
            BLOCK_SIZE=k_cache.shape[1] if kv_store is not None else 1,
            BLOCK_HQ=next_pow2(heads_q), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_D=next_pow2(dim // 2), num_warps=4,
        )
    return q_out, k_out
