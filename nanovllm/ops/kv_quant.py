"""FP8 KV: the quantization the store writes and the dequantization every read path applies.

A token's keys (and, separately, its values) of one KV head are quantized with one float32 scale:

    dynamic: scale = max(amax(|x| over head_dim) / fp8_max, MIN_SCALE)
    static:  scale = the layer's checkpoint ``k_scale`` / ``v_scale``
    stored   = clamp(x / scale, -fp8_max, fp8_max) in the fp8 dtype       (round to nearest)
    read     = stored.to(float32) * scale

The scales live beside the cache, indexed like it (``[num_blocks, block_size, Hkv]`` per layer,
for keys and for values: ``docs/kvcache.md``, "FP8 KV"). A dynamic scale never saturates (the
largest element maps to ``fp8_max``); with a static one the elements beyond ``fp8_max * scale``
saturate and are counted. This module is the torch reference; ``store_kv.py`` has the kernel.
"""
import torch

from nanovllm.utils.dtypes import FP8_DTYPES

SCALE_DTYPE = torch.float32
"""dtype of the scales."""
MIN_SCALE = torch.finfo(torch.float32).tiny
"""Smallest dynamic scale (an all-zero head row quantizes to zeros, not NaN)."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether the cache dtype ``dtype`` is one of the fp8 formats (stored with scales)."""
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of the fp8 format ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_mantissa_bits(dtype: torch.dtype) -> int:
    """Explicit mantissa bits of the fp8 format ``dtype`` (3 for e4m3fn, 2 for e5m2)."""
    return {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]


def fp8_subnormal_spacing(dtype: torch.dtype) -> float:
    """The step between the subnormal values of the fp8 format ``dtype``, below its smallest normal
    ``torch.finfo(dtype).smallest_normal`` (2^-9 for e4m3fn, 2^-16 for e5m2)."""
    return torch.finfo(dtype).smallest_normal / 2 ** fp8_mantissa_bits(dtype)


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, static_scale: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, Hkv, D]`` (any float dtype) to fp8 ``dtype`` (module doc).

    Returns:
        ``(stored [N, Hkv, D] in dtype, scale float32 [N, Hkv], saturated)``: ``saturated`` an
        int64 0-dim tensor, the elements clamped (always 0 with dynamic scales).
    """
    limit = fp8_max(dtype)
    x = x.to(SCALE_DTYPE)
    if static_scale is None:
        # divided by a tensor: CUDA torch turns a division by a Python float into a product with
        # its reciprocal, which is not the IEEE quotient the store kernel computes
        scale = (x.abs().amax(-1) / torch.tensor(limit, dtype=SCALE_DTYPE, device=x.device)).clamp_(min=MIN_SCALE)
    else:
        scale = torch.full(x.shape[:-1], static_scale, dtype=SCALE_DTYPE, device=x.device)
    scaled = x / scale[..., None]
    saturated = (scaled.abs() > limit).sum() if static_scale is not None else scaled.new_zeros((), dtype=torch.int64)
    return scaled.clamp_(-limit, limit).to(dtype), scale, saturated


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache ``[..., D]`` in ``dtype``: ``cache.to(float32) * scale[..., None]`` with
    scales (``scale`` ``[...]`` float32, indexed as ``cache`` without its last dim), else a cast."""
    if scale is None:
        return cache.to(dtype)
    return cache.to(SCALE_DTYPE, copy=True).mul_(scale[..., None]).to(dtype)


def check_scales(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """ValueError unless ``scale`` fits ``cache`` ``[..., D]``: float32 of ``cache.shape[:-1]``
    for an fp8 cache, None for any other (scales belong to fp8 storage only)."""
    if not is_fp8(cache.dtype):
        if scale is not None:
            raise ValueError(f"{name} given for a {cache.dtype} cache (scales belong to an fp8 cache)")
        return
    if scale is None:
        raise ValueError(f"a {cache.dtype} cache needs {name} (float32 {tuple(cache.shape[:-1])})")
    if scale.dtype != SCALE_DTYPE or scale.shape != cache.shape[:-1]:
        raise ValueError(f"{name} must be float32 {tuple(cache.shape[:-1])} for a cache of {tuple(cache.shape)}; "
                         f"got {scale.dtype} {tuple(scale.shape)}")
