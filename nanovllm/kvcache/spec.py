"""The per-layer KV spec: what one attention layer stores per token and how attention reads it.

The model declares it (each attention layer's :meth:`~nanovllm.layers.attention.Attention.kv_spec`),
the cache takes it (one spec per layer, in order) and sizes both tiers from it, and the kernels'
argument checks compare against it. Today one tensor holds every layer, so the layers must agree
on their storage (:func:`uniform_storage`); the attention of each layer may still differ (its
sliding window).
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKVSpec:
    """One layer's KV on one rank.

    Attributes:
        num_kv_heads: KV heads of this rank (a tensor-parallel rank holds a share).
        head_dim: elements per head, keys and values alike.
        dtype: element type of the stored keys and values.
        sliding_window: each query attends to the last ``sliding_window`` keys (itself included);
            None: every earlier key (full causal attention).
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def uniform_storage(specs: list[LayerKVSpec]) -> LayerKVSpec:
    """The storage every layer shares (heads, head_dim, dtype), as layer 0's spec without a window.

    Raises:
        ValueError: no layers, or layers whose KV heads, head_dim or dtype differ (one tensor holds
            every layer), naming the first that differs.
    """
    if not specs:
        raise ValueError("the model has no attention layers")
    first = specs[0]
    for i, spec in enumerate(specs):
        if (spec.num_kv_heads, spec.head_dim, spec.dtype) != (first.num_kv_heads, first.head_dim, first.dtype):
            raise ValueError(f"attention layer {i} stores {spec.num_kv_heads} KV heads x {spec.head_dim} in "
                             f"{spec.dtype}, layer 0 {first.num_kv_heads} x {first.head_dim} in {first.dtype}: "
                             f"layers with different KV storage are not supported")
    return LayerKVSpec(first.num_kv_heads, first.head_dim, first.dtype)
