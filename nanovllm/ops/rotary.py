"""Rotary position embedding (Su et al., RoFormer 2021) of q and k in one launch, optionally
after Qwen3's per-head RMSNorm of q and k (the same launch).

The table ``cos_sin_cache [2, max_position, R/2]`` holds cos and sin of ``position * inv_freq``
for the ``R/2`` rotary pairs (``R = rotary_dim <= head_dim``; any scaling of the frequencies or
of cos/sin, e.g. LongRoPE's, is already in it). The first ``R`` dims of every head rotate, the
rest pass through unchanged (partial rotary: GLM rotates half of each head). Pairs are either
"rotate half" (Llama/Qwen/Phi-3 checkpoints: pair ``i`` is dims ``(i, i + R/2)``) or interleaved
(GLM: pair ``i`` is dims ``(2i, 2i + 1)``); each pair ``(x1, x2)`` becomes
``(x1 cos - x2 sin, x2 cos + x1 sin)``, computed in float32 and rounded once to the input dtype.
The optional norm is :func:`nanovllm.ops.rms_norm_ref`'s per head (over all ``head_dim`` dims),
with its roundings (normalised row, then weight), so that the fused launch computes what an
RMSNorm launch followed by a RoPE launch computes (up to the order of the mean square's float32
sum).

With ``kv_store`` the same launch also writes the rotated keys and the values into their slots of
the paged KV cache, as :func:`nanovllm.ops.store_kvcache` writes them: a decode step then runs one
launch per layer instead of two between the qkv projection and attention.
"""

from typing import NamedTuple

import torch

from ._triton import next_pow2
from .backend import tl, triton, use_triton
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
    dim = q.shape[2]
    if cos_sin_cache.dim() != 3 or cos_sin_cache.shape[0] != 2 or not 1 <= cos_sin_cache.shape[2] <= dim // 2:
        raise ValueError(f"expected cos_sin_cache [2, max_position, R/2] with 2 <= R <= head_dim={dim}; got cache "
                         f"{tuple(cos_sin_cache.shape)}")
    if qk_norm is not None:
        q_weight, k_weight, _ = qk_norm
        if q_weight.shape != (dim,) or k_weight.shape != (dim,):
            raise ValueError(f"qk_norm weights must be [D={dim}]; got {tuple(q_weight.shape)} and "
                             f"{tuple(k_weight.shape)}")
    if kv_store is not None:
        if not isinstance(kv_store, KVStore):
            raise ValueError(f"kv_store must be a KVStore(value, k_cache, v_cache, slot_mapping); got "
                             f"{type(kv_store).__name__}")
        check_store_args(k, *kv_store)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    xr = x[..., :rot].float()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, dim=-1)
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     qk_norm: QKNorm | None = None, kv_store: KVStore | None = None,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`apply_rotary` (same arguments and results; the store through
    :func:`nanovllm.ops.store_kvcache_ref`)."""
    _check_args(positions, q, k, cos_sin_cache, qk_norm, kv_store)
    if qk_norm is not None:
        q, k = rms_norm_ref(q, qk_norm[0], qk_norm[2]), rms_norm_ref(k, qk_norm[1], qk_norm[2])
    cos, sin = cos_sin_cache[:, positions].unsqueeze(-2)
    q, k = _rotate_ref(q, cos, sin, interleaved), _rotate_ref(k, cos, sin, interleaved)
    if kv_store is not None:
        store_kvcache_ref(k, *kv_store)
    return q, k


def _rotary_torch(positions, q, k, cos_sin_cache, interleaved: bool):
    """:func:`apply_rotary_ref`'s result, bit for bit, in fewer torch ops per tensor: the rotated
    dims as ``x * c + partner(x) * s``, with ``c`` the pair's cos on both of its dims, ``s`` its
    sin negated on the pair's first dim (``x2 * -sin == -(x2 * sin)`` exactly, so
    ``x1 cos + x2 (-sin)`` rounds as ``x1 cos - x2 sin``) and ``partner`` swapping each pair."""
    cos, sin = cos_sin_cache[:, positions].unsqueeze(-2)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)
    else:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    return tuple(_rotate_full(x, cos, sin, interleaved) for x in (q, k))


def _rotate_full(x, cos, sin, interleaved: bool):
    rot = cos.shape[-1]
    xr = x[..., :rot]
    if interleaved:
        swapped = xr.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        swapped = torch.cat((x2, x1), dim=-1)
    y = (xr.float() * cos + swapped.float() * sin).to(x.dtype)
    return y if rot == x.shape[-1] else torch.cat((y, x[..., rot:]), dim=-1)


@triton.jit
def _rotate_heads(x_ptr, w_ptr, t, num_heads, stride_t, stride_h, cos, sin, partner, rotated, dim, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's heads of x ``[BLOCK_H, BLOCK_D]``, normalised (NORM) and rotated where ``rotated``
    (``x * cos + x[partner] * sin``, cos/sin per dim with the sign folded in), rounded to x's
    dtype, and their mask."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < dim)[None, :]
    src = x_ptr + t * stride_t + h[:, None] * stride_h
    x = tl.load(src + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    pf = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:  # rms_norm's roundings: the normalised row, then times the weight
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 1) / dim + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d < dim, other=0.0).to(tl.float32)[None, :]
        xf = (w * (xf * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        pf = (wp * (pf * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    return tl.where(rotated[None, :], xf * cos + pf * sin, xf).to(x.dtype), mask


@triton.jit
def _store_rows(dst_ptr, stride_h, y, mask, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the rows ``y [BLOCK_H, BLOCK_D]`` at ``dst_ptr + h * stride_h`` (cast to the
    destination's dtype)."""
    dst = dst_ptr + tl.arange(0, BLOCK_H)[:, None] * stride_h + tl.arange(0, BLOCK_D)[None, :]
    tl.store(dst, y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_cb", "stride_vcb"])
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, heads_q, heads_kv, dim, rot_half, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache_kind, stride_cache_pos,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NORM: tl.constexpr, STORE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rotated = d < 2 * rot_half
    if INTERLEAVED:  # pair i: dims (2i, 2i + 1)
        pair, partner, first = d // 2, d ^ 1, d % 2 == 0
    else:  # pair i: dims (i, i + R/2)
        first = d < rot_half
        pair = tl.where(first, d, d - rot_half)
        partner = tl.where(first, d + rot_half, d - rot_half)
    pair = tl.where(rotated, pair, 0)
    partner = tl.where(rotated, partner, d)
    row = cache_ptr + pos * stride_cache_pos + pair
    cos = tl.load(row, mask=rotated, other=1.0)[None, :]
    sin = tl.load(row + stride_cache_kind, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)[None, :]
    q_rot, q_mask = _rotate_heads(q_ptr, qw_ptr, t, heads_q, stride_qt, stride_qh, cos, sin, partner, rotated, dim,
                                  eps, NORM, BLOCK_HQ, BLOCK_D)
    _store_rows(q_out_ptr + t * heads_q * dim, dim, q_rot, q_mask, BLOCK_HQ, BLOCK_D)
    k_rot, k_mask = _rotate_heads(k_ptr, kw_ptr, t, heads_kv, stride_kt, stride_kh, cos, sin, partner, rotated, dim,
                                  eps, NORM, BLOCK_HK, BLOCK_D)
    _store_rows(k_out_ptr + t * heads_kv * dim, dim, k_rot, k_mask, BLOCK_HK, BLOCK_D)
    if STORE:  # store_kvcache's writes: the rotated key and the value into the token's slot
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            _store_rows(k_cache_ptr + block * stride_cb + offset * stride_cs, stride_ch, k_rot, k_mask, BLOCK_HK,
                        BLOCK_D)
            src = v_ptr + t * stride_vt + tl.arange(0, BLOCK_HK)[:, None] * stride_vh + d[None, :]
            v = tl.load(src, mask=k_mask, other=0.0)
            _store_rows(v_cache_ptr + block * stride_vcb + offset * stride_vcs, stride_vch, v, k_mask, BLOCK_HK,
                        BLOCK_D)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 qk_norm: QKNorm | None = None, kv_store: KVStore | None = None,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k at ``positions``, after the per-head RMSNorm ``qk_norm`` when given; with
    ``kv_store``, the rotated keys and the values also go into the paged KV cache.

    Args:
        positions: int64 ``[N]`` absolute positions, each below ``max_position``.
        q: ``[N, Hq, D]``; k: ``[N, Hkv, D]`` (token and head strides free, D contiguous);
            float16/bfloat16/float32.
        cos_sin_cache: float32 ``[2, max_position, R/2]``: cos and sin of ``position * inv_freq``
            for the ``R/2`` rotary pairs; the first ``R`` (even, ``2 <= R <= D``) dims of each head
            rotate, dims ``R..D-1`` pass through.
        qk_norm: ``(q weight [D], k weight [D], eps)`` in q's dtype: Qwen3's ``q_norm`` /
            ``k_norm`` (:func:`nanovllm.ops.rms_norm` of every head) applied first.
        kv_store: :class:`KVStore`: the values and the cache slots that
            :func:`nanovllm.ops.store_kvcache` would take; the rotated keys (in the cache's dtype)
            and the values are written there, in place.
        interleaved: pairs are dims ``(2i, 2i + 1)`` (GLM) instead of ``(i, i + R/2)``.

    Returns:
        ``(q', k')``, contiguous, in the input dtypes.

    Raises:
        ValueError: shapes that disagree, a table wider than ``D/2`` pairs, norm weights that are
            not ``[D]``, a ``kv_store`` that is not a :class:`KVStore` or that
            :func:`nanovllm.ops.store_kvcache` would reject. Positions and slots are not
            range-checked on the device.

    CUDA: one Triton program per token normalises (optionally) and rotates all of its q and k
    heads (each dim with its pair's partner), and stores its key and value rows. CPU (and strided
    inputs): :func:`nanovllm.ops.rms_norm` of q and k, then :func:`_rotary_torch`, bit for bit the
    reference's rotation in fewer torch ops, then :func:`nanovllm.ops.store_kvcache`.
    """
    _check_args(positions, q, k, cos_sin_cache, qk_norm, kv_store)
    if not use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1 or (
            kv_store is not None and kv_store.value.stride(-1) != 1):
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        q, k = _rotary_torch(positions, q, k, cos_sin_cache, interleaved)
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
            positions, q, k, cos_sin_cache, q_out, k_out, q_weight, k_weight, heads_q, k.shape[1], dim,
            cos_sin_cache.shape[2], eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
            v, k_cache, v_cache, slots.contiguous(), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), NORM=qk_norm is not None, STORE=kv_store is not None, INTERLEAVED=interleaved,
            BLOCK_SIZE=k_cache.shape[1] if kv_store is not None else 1,
            BLOCK_HQ=next_pow2(heads_q), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_D=next_pow2(dim), num_warps=4,
        )
    return q_out, k_out
