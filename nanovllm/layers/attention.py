"""Attention over the paged KV cache (GPU-only mode).

The model runner binds ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, num_kv_heads,
head_dim]`` views) to every layer; until then the layer attends without a cache (warm-up).
"""
import torch
from torch import nn

from nanovllm.ops import decode_attention, prefill_attention, store_kvcache
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Causal multi-head attention with GQA on packed q ``[N, Hq, D]``, k, v ``[N, Hkv, D]``."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        has_cache = self.k_cache.numel() > 0
        if has_cache and ctx.slot_mapping is not None:
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale,
                                     self.k_cache, self.v_cache, ctx.block_tables)
        return decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables,
                                ctx.context_lens, self.scale)
