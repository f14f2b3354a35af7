"""Scatter new tokens' keys and values into the paged KV cache, quantized to fp8 when the cache
is (per-(token, KV head) scales written beside it: ``kv_quant.py``)."""

from typing import NamedTuple

import torch

from nanovllm.utils.ints import cdiv

from ._triton import check_head_dim, next_pow2
from .backend import tl, triton, use_triton
from .kv_quant import (MIN_SCALE, check_scales, dequantize, fp8_mantissa_bits, fp8_max, fp8_subnormal_spacing,
                       quantize_ref)


class KVScales(NamedTuple):
    """The scales of an fp8 cache and how :func:`store_kvcache` writes them.

    Attributes:
        k_scale, v_scale: float32 ``[num_blocks, block_size, Hkv]``, indexed like the caches.
        static: ``(k_scale, v_scale)`` floats of the layer (a checkpoint's), None: dynamic scales.
        saturated: int64 ``[1]`` on the caches' device: the store adds the elements it clamps to
            the fp8 range (with static scales; dynamic ones never clamp).
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    static: tuple[float, float] | None = None
    saturated: torch.Tensor | None = None


def check_store_args(key, value, k_cache, v_cache, slot_mapping, scales: KVScales | None = None) -> None:
    """ValueError unless :func:`store_kvcache` takes these arguments (shapes, strides, head_dim,
    scales exactly when the caches are fp8)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} differ from the cache's {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [num_tokens={key.shape[0]}]; got {tuple(slot_mapping.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64; got {slot_mapping.dtype}")
    dtypes = (key.dtype, value.dtype, k_cache.dtype, v_cache.dtype)
    if not all(dtype.is_floating_point for dtype in dtypes):
        raise ValueError(f"key, value, k_cache and v_cache must be floating point; got {dtypes}")
    check_head_dim(key.shape[2])
    check_scales(k_cache, None if scales is None else scales.k_scale, "k_scale")
    check_scales(v_cache, None if scales is None else scales.v_scale, "v_scale")
    if scales is not None and scales.saturated is not None and (
            scales.saturated.shape != (1,) or scales.saturated.dtype != torch.int64):
        raise ValueError(f"saturated must be int64 [1]; got {scales.saturated.dtype} {tuple(scales.saturated.shape)}")


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales | None = None,
    return_stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Torch reference of :func:`store_kvcache` (same arguments, same result); indexes with a host
    sync. Each row is quantized once: the stored rows for the store (and the read-back), a padding
    row (slot -1) for the read-back only."""
    check_store_args(key, value, k_cache, v_cache, slot_mapping, scales)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    stored_rows = []
    for which, (x, cache) in enumerate(((key, k_cache), (value, v_cache))):
        if scales is None:
            cache[blocks, offsets] = x[valid].to(cache.dtype)
            if return_stored:
                stored_rows.append(x.to(cache.dtype).to(x.dtype))
            continue
        static = None if scales.static is None else scales.static[which]
        stored, scale, saturated = quantize_ref(x[valid], cache.dtype, static)
        cache[blocks, offsets] = stored
        (scales.k_scale, scales.v_scale)[which][blocks, offsets] = scale
        if scales.saturated is not None:
            scales.saturated.add_(saturated)
        if return_stored:
            back = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            back[valid] = dequantize(stored, scale, x.dtype)
            back[~valid] = dequantize(*quantize_ref(x[~valid], cache.dtype, static)[:2], x.dtype)
            stored_rows.append(back)
    return tuple(stored_rows) if return_stored else None


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, SPACING: tl.constexpr):
    """float32 ``x`` (within the fp8 range) rounded to the grid of the fp8 format with ``MANTISSA``
    mantissa bits, smallest normal ``MIN_NORMAL`` and subnormal step ``SPACING``, to nearest even:
    normal values on their bits (a carry raises the exponent), subnormal ones to multiples of the
    step (adding 1.5 * 2^23 rounds the magnitude to an integer; the step is a power of two, so the
    scalings are exact). The fp8 cast of the result is exact, so the GPU and Triton's interpreter (whose fp8 cast
    drops the carry) store the bits of torch's cast."""
    SHIFT: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) & -(1 << SHIFT)).to(tl.float32, bitcast=True)
    # times the step's reciprocal, not divided by the step: an exact power-of-two product, where
    # the GPU lowers a float32 ``/`` to an approximate division
    subnormal = ((tl.abs(x) * (1.0 / SPACING) + 12582912.0) - 12582912.0) * SPACING
    subnormal = subnormal * tl.where(bits < 0, -1.0, 1.0)  # the sign kept, -0.0 included (a negation may compile to 0 - x)
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal)


@triton.jit
def _quantize(x, mask, scale_ptr, static_scale, saturated_ptr, BLOCK_H: tl.constexpr, FP8_MAX: tl.constexpr,
              FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SPACING: tl.constexpr,
              MIN_SCALE: tl.constexpr, STATIC: tl.constexpr):
    """``x`` float ``[BLOCK_H, BLOCK_D]`` (zero outside head_dim) scaled into the fp8 range, per head
    row, and rounded to its grid: ``(x / scale on the grid, scale [BLOCK_H])``, both float32; the
    scales of the rows of ``mask`` (the stored elements) stored at ``scale_ptr`` ``[BLOCK_H]``, and
    their clamped elements counted into ``saturated_ptr`` (static scales)."""
    x = x.to(tl.float32)
    rows = tl.max(mask.to(tl.int32), 1) > 0
    if STATIC:
        scale = tl.zeros([BLOCK_H], tl.float32) + static_scale
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), FP8_MAX), MIN_SCALE)
    x = tl.math.div_rn(x, scale[:, None])  # IEEE division, as torch's: the same bits as the reference
    if STATIC:
        tl.atomic_add(saturated_ptr, tl.sum(tl.sum(((tl.abs(x) > FP8_MAX) & mask).to(tl.int64), 1), 0))
    tl.store(scale_ptr, scale, mask=rows)
    x = _round_to_fp8_grid(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX), FP8_MANTISSA, FP8_MIN_NORMAL, FP8_SPACING)
    return x, scale


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, saturated_ptr,
    k_out_ptr, v_out_ptr, static_k_scale, static_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SPACING: tl.constexpr,
    MIN_SCALE: tl.constexpr, RETURN_STORED: tl.constexpr,
):
    """One token: its keys and values of every KV head into its slot; ``QUANTIZE`` (an fp8
    cache): each head row scaled into the fp8 range first (``_quantize``), its scale stored beside
    the slot (scales ``[num_blocks, block_size, Hkv]``, head stride 1). ``RETURN_STORED``: the
    token's rows as stored, read back in the outputs' dtype (dequantized), to ``k_out_ptr`` and
    ``v_out_ptr`` (contiguous ``[num_tokens, Hkv, D]``), a padding token's (slot -1) as it would
    be stored."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot  # a tensor mask, not a scalar
    inside = (h < NUM_HEADS) & (d < HEAD_DIM)
    mask = inside & (slots >= 0)
    if RETURN_STORED:
        load_mask = inside
    else:
        load_mask = mask
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=load_mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=load_mask, other=0.0)
    if QUANTIZE:
        heads = tl.arange(0, BLOCK_H)
        k, k_scale = _quantize(k, mask, k_scale_ptr + block * stride_ksb + offset * stride_kss + heads,
                               static_k_scale, saturated_ptr, BLOCK_H, FP8_MAX, FP8_MANTISSA,
                               FP8_MIN_NORMAL, FP8_SPACING, MIN_SCALE, STATIC)
        v, v_scale = _quantize(v, mask, v_scale_ptr + block * stride_vsb + offset * stride_vss + heads,
                               static_v_scale, saturated_ptr, BLOCK_H, FP8_MAX, FP8_MANTISSA,
                               FP8_MIN_NORMAL, FP8_SPACING, MIN_SCALE, STATIC)
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)
    if RETURN_STORED:
        k_back = k.to(tl.float32)
        v_back = v.to(tl.float32)
        if QUANTIZE:
            k_back = k_back * k_scale[:, None]
            v_back = v_back * v_scale[:, None]
        out = token * NUM_HEADS * HEAD_DIM + h * HEAD_DIM + d
        tl.store(k_out_ptr + out, k_back.to(k_out_ptr.dtype.element_ty), mask=inside)
        tl.store(v_out_ptr + out, v_back.to(v_out_ptr.dtype.element_ty), mask=inside)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales | None = None,
    return_stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Write each token's key and value into its slot of the paged KV cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the cache's);
            rows may be strided (e.g. views of a fused qkv projection).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous last dim;
            float8_e4m3fn / float8_e5m2 caches store each (token, KV head) row quantized
            (``nanovllm.ops.kv_quant``: ``clamp(x / scale)``, scale = amax / fp8_max, or the
            static scale), its float32 scale written to ``scales`` at the same slot.
        slot_mapping: int32/int64 ``[num_tokens]``; token t goes to flat slot
            ``block_id * block_size + offset``; ``-1`` skips the token (padding).
        scales: :class:`KVScales`, exactly when the caches are fp8.
        return_stored: also return what was written, read back.

    Returns:
        None; with ``return_stored``, ``(key, value)`` as the cache holds them, read back in
        ``key``'s and ``value``'s dtypes, ``[num_tokens, num_kv_heads, head_dim]`` (``key`` and
        ``value`` themselves where no cast happens): an fp8 cache's rows dequantized with the
        scales just written (``kv_quant.dequantize``), another cache's cast to its dtype and
        back; a padding token's rows (slot -1) as they would be stored. Each row is quantized
        once, for the cache and the returned rows alike.

    Raises:
        ValueError: mismatched shapes, a non-contiguous cache head_dim, head_dim outside 1..256,
            a slot_mapping that is not int32/int64, tensors that are not floating point, scales
            missing for an fp8 cache, given for another, or not float32 ``[num_blocks,
            block_size, Hkv]``; off CUDA, a slot outside -1..num_blocks * block_size - 1.

    CUDA tensors use a Triton kernel (one program per token, no host sync, so it is CUDA-graph
    capturable); slots are not range-checked there: a slot >= num_blocks * block_size is
    undefined behaviour. CPU: two ``index_copy_`` into the caches viewed as slot rows when no
    slot is -1 and the caches' block and offset dimensions merge into one; otherwise, and on
    other devices, :func:`store_kvcache_ref`.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping, scales)
    if not use_triton(key):
        padded = _check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
        stored = None if padded or key.device.type != "cpu" else \
            _store_cpu(key, value, k_cache, v_cache, slot_mapping, scales, return_stored)
        if stored is None:
            return store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping, scales, return_stored)
        return stored if return_stored else None
    num_tokens, num_heads, head_dim = key.shape
    out = (torch.empty(key.shape, dtype=key.dtype, device=key.device),
           torch.empty(value.shape, dtype=value.dtype, device=value.device)) if return_stored else None
    if num_tokens == 0:
        return out
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    quantize = scales is not None
    k_scale, v_scale = (scales.k_scale, scales.v_scale) if quantize else (k_cache, v_cache)  # not read unscaled
    if quantize and k_scale.stride(-1) != 1 or quantize and v_scale.stride(-1) != 1:
        raise ValueError("k_scale and v_scale need a contiguous last (KV head) dimension")
    static = quantize and scales.static is not None
    saturated = scales.saturated if static and scales.saturated is not None else slot_mapping  # not written
    if static and scales.saturated is None:
        raise ValueError("static scales need a saturated counter (int64 [1])")
    k_out, v_out = out if return_stored else (key, value)  # not written without return_stored
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), k_scale, v_scale, saturated, k_out, v_out,
        scales.static[0] if static else 1.0, scales.static[1] if static else 1.0,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1], QUANTIZE=quantize, STATIC=static,
        FP8_MAX=fp8_max(k_cache.dtype) if quantize else 1.0,
        FP8_MANTISSA=fp8_mantissa_bits(k_cache.dtype) if quantize else 0,
        FP8_MIN_NORMAL=torch.finfo(k_cache.dtype).smallest_normal if quantize else 0.0,
        FP8_SPACING=fp8_subnormal_spacing(k_cache.dtype) if quantize else 1.0, MIN_SCALE=MIN_SCALE,
        RETURN_STORED=return_stored,
    )
    return out


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> bool:
    """ValueError naming the first slot outside -1..num_slots-1 (a host sync: CPU paths only);
    else whether a slot is -1 (padding)."""
    if not slot_mapping.numel():
        return False
    low, high = (int(x) for x in slot_mapping.aminmax())
    if low < -1 or high >= num_slots:
        i = int(((slot_mapping < -1) | (slot_mapping >= num_slots)).nonzero()[0])
        raise ValueError(f"slot_mapping[{i}]={int(slot_mapping[i])} is outside -1..{num_slots - 1} "
                         f"(num_blocks * block_size - 1)")
    return low == -1


def _slot_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache [num_blocks, block_size, ...]`` (a cache or its scales) viewed as slot rows
    ``[num_blocks * block_size, ...]`` (sharing its storage), or None when the block and offset
    strides do not merge."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1):
        return None
    return cache.view(-1, *cache.shape[2:])


def _store_cpu(key, value, k_cache, v_cache, slot_mapping, scales: KVScales | None,
               return_stored: bool) -> tuple[torch.Tensor, ...] | None:
    """CPU :func:`store_kvcache` of slots without padding: one ``index_copy_`` per cache (a few
    ops instead of the reference's masked indexing; fp8 rows quantized by
    :func:`~nanovllm.ops.kv_quant.quantize_ref` and copied as bytes, their scales beside them).
    Returns the rows as stored, read back (:func:`store_kvcache`'s ``return_stored``; empty
    without it), or None, with nothing written, when the caches' or the scales' block and offset
    dimensions do not merge."""
    rows = [_slot_rows(k_cache), _slot_rows(v_cache)]
    scale_rows = [None, None] if scales is None else [_slot_rows(scales.k_scale), _slot_rows(scales.v_scale)]
    if any(r is None for r in rows) or (scales is not None and any(r is None for r in scale_rows)):
        return None
    slots = slot_mapping.long()
    stored_rows = []
    for which, (dst, src, dst_scale) in enumerate(zip(rows, (key, value), scale_rows)):
        if dst_scale is None:
            stored = src.to(dst.dtype)
            dst.index_copy_(0, slots, stored)
            if return_stored:
                stored_rows.append(stored.to(src.dtype))
            continue
        stored, scale, saturated = quantize_ref(src, dst.dtype, None if scales.static is None
                                                else scales.static[which])
        dst.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))  # no fp8 index_copy_ on CPU
        dst_scale.index_copy_(0, slots, scale)
        if scales.saturated is not None:
            scales.saturated.add_(saturated)
        if return_stored:
            stored_rows.append(dequantize(stored, scale, src.dtype))
    return tuple(stored_rows)


def gather_kvcache(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
                   scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy one sequence's first ``num_tokens`` cached rows out of the paged cache.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a k or v cache).
        block_table: int32/int64 ``[max_blocks]``, the sequence's block ids in order; only the
            first ``ceil(num_tokens / block_size)`` entries are read.
        num_tokens: rows to return (>= 0).
        scale: an fp8 cache's scales ``[num_blocks, block_size, num_kv_heads]`` (float32), None
            for another cache.
        dtype: the dtype returned; None: the cache's (scales need a dtype).

    Returns:
        ``[num_tokens, num_kv_heads, head_dim]`` in ``dtype`` (a new tensor), dequantized
        (``kv_quant.dequantize``) when scales are given.

    Raises:
        ValueError: scales that do not fit the cache (``kv_quant.check_scales``), or scales without
            a dtype.
    """
    check_scales(cache, scale, "scale")
    if scale is not None and dtype is None:
        raise ValueError(f"gathering from a {cache.dtype} cache needs the dtype to dequantize to")
    blocks = block_table[: cdiv(num_tokens, cache.shape[1])]
    rows = cache.index_select(0, blocks).flatten(0, 1)[:num_tokens]
    if scale is not None:
        return dequantize(rows, scale.index_select(0, blocks).flatten(0, 1)[:num_tokens], dtype)
    return rows if dtype is None else rows.to(dtype)
