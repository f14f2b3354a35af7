"""The per-layer KV spec: what one attention layer stores per token and how attention reads it.

The model declares it (each attention layer's :meth:`~nanovllm.layers.attention.Attention.kv_spec`),
the cache takes it (one spec per layer, in order) and sizes both tiers from it, and the kernels'
argument checks compare against it. Today one tensor holds every layer, so the layers must agree
on their storage (:func:`uniform_storage`); the attention of each layer may still differ (its
sliding window, its static fp8 scales).

The storage dtype and the compute dtype are distinct: an fp8 cache (``kv_cache_dtype``) stores
keys and values in 8 bits with one float32 scale per (token, KV head) each (``scale_layout``
"token_head"; ``nanovllm.ops.kv_quant``), read back in the model's dtype.
"""
from dataclasses import dataclass

import torch

from nanovllm.ops.kv_quant import SCALE_DTYPE, is_fp8


@dataclass(frozen=True)
class LayerKVSpec:
    """One layer's KV on one rank.

    Attributes:
        num_kv_heads: KV heads of this rank (a tensor-parallel rank holds a share).
        head_dim: elements per head, keys and values alike.
        dtype: the compute dtype (the model's): what attention reads the keys and values as.
        sliding_window: each query attends to the last ``sliding_window`` keys (itself included);
            None: every earlier key (full causal attention).
        cache_dtype: element type of the stored keys and values (the storage dtype); None given:
            ``dtype``, so two specs storing the same dtype compare equal.
        static_scales: ``(k_scale, v_scale)`` of an fp8 cache from the checkpoint (one per layer;
            elements beyond the fp8 range saturate, counted); None: dynamic scales per (token, KV
            head) from the data.
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None
    cache_dtype: torch.dtype | None = None
    static_scales: tuple[float, float] | None = None

    def __post_init__(self):
        if self.cache_dtype is None:
            object.__setattr__(self, "cache_dtype", self.dtype)

    @property
    def scale_layout(self) -> str:
        """"token_head" for an fp8 cache (one float32 scale per (token, KV head) for keys and one for
        values, indexed like the cache without head_dim), else "none" (no scales)."""
        return "token_head" if is_fp8(self.cache_dtype) else "none"

    @property
    def scaled(self) -> bool:
        """The cache keeps scales beside its keys and values."""
        return self.scale_layout != "none"

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values, their scales included."""
        per_head = self.head_dim * self.cache_dtype.itemsize + (SCALE_DTYPE.itemsize if self.scaled else 0)
        return 2 * self.num_kv_heads * per_head


def uniform_storage(specs: list[LayerKVSpec]) -> LayerKVSpec:
    """The storage every layer shares (heads, head_dim, compute and storage dtypes), as layer 0's
    spec without a window or static scales.

    Raises:
        ValueError: no layers, or layers whose KV heads, head_dim or dtypes differ (one tensor holds
            every layer), naming the first that differs.
    """
    if not specs:
        raise ValueError("the model has no attention layers")
    first = specs[0]

    def storage(spec):
        return spec.num_kv_heads, spec.head_dim, spec.dtype, spec.cache_dtype

    for i, spec in enumerate(specs):
        if storage(spec) != storage(first):
            raise ValueError(f"attention layer {i} stores {spec.num_kv_heads} KV heads x {spec.head_dim} in "
                             f"{spec.cache_dtype}, layer 0 {first.num_kv_heads} x {first.head_dim} in "
                             f"{first.cache_dtype}: layers with different KV storage are not supported")
    return LayerKVSpec(first.num_kv_heads, first.head_dim, first.dtype, cache_dtype=first.cache_dtype)
