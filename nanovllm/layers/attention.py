"""Attention over the KV cache: a thin call into the cache the model runner binds."""
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.kvcache.spec import LayerKVSpec

Rotate = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""RoPE of the new tokens' q and k: ``rotate(q, k, kv_store=None) -> (q', k')``, which also writes
k' and the values into the KV cache when given a :class:`nanovllm.ops.rotary.KVStore` (a bound
:class:`nanovllm.layers.rotary_embedding.RotaryEmbedding`)."""


class Attention(nn.Module):
    """Causal multi-head attention with GQA on packed q ``[N, Hq, D]``, k, v ``[N, Hkv, D]``.

    The model runner binds the rank's :class:`nanovllm.kvcache.cache.KVCache` (``kv_cache``) and
    this layer's index (``layer_id``); the cache stores k, v and attends over both of its tiers as
    the current step's context says (``nanovllm.kvcache.context``). ``sliding_window`` (tokens,
    None: full causal attention): a query at position p attends to the keys at p - W + 1 .. p; the
    model sets it from its config before the cache is built, and it travels in :meth:`kv_spec`.
    ``static_kv_scales`` (``(k_scale, v_scale)`` floats, None: dynamic): a checkpoint's per-layer
    fp8 KV scales, set by the loader (``nanovllm.models.loader``), used when the cache is fp8.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window = scale, sliding_window
        self.layer_id, self.kv_cache = -1, None
        self.static_kv_scales: tuple[float, float] | None = None

    def kv_spec(self, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> LayerKVSpec:
        """What this layer stores per token when the model runs in ``dtype`` and the cache stores
        ``cache_dtype`` (None: ``dtype``), its window, and with an fp8 cache its static scales."""
        spec = LayerKVSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window, cache_dtype)
        return dataclasses.replace(spec, static_scales=self.static_kv_scales) if spec.scaled else spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate: Rotate | None = None) -> torch.Tensor:
        """Attention of the new tokens; ``rotate`` (RoPE not yet applied to q and k) runs in the
        cache, which stores the keys and values in the same launch."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound (the model runner binds one)")
        return self.kv_cache.attend(self.layer_id, q, k, v, rotate)
