"""Attention over the KV cache.

GPU-only mode: the model runner binds ``k_cache`` / ``v_cache`` (``[num_blocks, block_size,
num_kv_heads, head_dim]`` views) to every layer; until then the layer attends without a cache
(warm-up, scoring). The runner also binds the sparse policy, whose ``paged_prefill_attention``
computes prefill (dense, or XAttention's block-sparse prefill). Offload mode: the runner binds the
``OffloadEngine`` and the sparse policy, and each prefill chunk / decode step goes to the policy's
chunked pipeline.
"""
import torch
from torch import nn

from nanovllm.kvcache.sparse.policy import PolicyContext
from nanovllm.ops import decode_attention, prefill_attention, store_kvcache
from nanovllm.utils.context import OffloadBatch, get_context


class Attention(nn.Module):
    """Causal multi-head attention with GQA on packed q ``[N, Hq, D]``, k, v ``[N, Hkv, D]``."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])
        self.layer_id = -1
        self.offload_engine = self.policy = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.offload is not None:
            return self._offload_forward(q, k, v, ctx.is_prefill, ctx.offload)
        if self.k_cache.numel() > 0 and ctx.slot_mapping is not None:
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill and self.policy is not None:
            return self.policy.paged_prefill_attention(q, k, v, ctx, self.k_cache, self.v_cache, self.layer_id)
        if ctx.is_prefill:
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale,
                                     self.k_cache, self.v_cache, ctx.block_tables)
        return decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables,
                                ctx.context_lens, self.scale)

    def _offload_forward(self, q, k, v, is_prefill: bool, batch: OffloadBatch) -> torch.Tensor:
        engine, policy = self.offload_engine, self.policy
        if is_prefill:  # one sequence, one chunk
            out = policy.compute_chunked_prefill(q, k, v, engine, _prefill_context(batch, self.layer_id))
            if self.layer_id + 1 < engine.num_layers:  # the next layer's first blocks load under its GEMMs
                policy.prefetch(engine, _prefill_context(batch, self.layer_id + 1))
            return out
        engine.store_decode_tokens(self.layer_id, batch.rows, batch.offsets, k, v)
        outs = []
        for i in range(q.size(0)):
            outs.append(policy.compute_chunked_decode(q[i:i + 1], engine, _decode_context(batch, i, self.layer_id)))
            nxt, layer = (i + 1, self.layer_id) if i + 1 < q.size(0) else (0, self.layer_id + 1)
            if layer < engine.num_layers:  # keep the copy engine busy through the rest of the layer
                policy.prefetch(engine, _decode_context(batch, nxt, layer))
        return torch.cat(outs)


def _prefill_context(batch: OffloadBatch, layer_id: int) -> PolicyContext:
    return PolicyContext(layer_id, batch.cpu_blocks[0], batch.block_lens[0], True, chunk_block=batch.chunk_blocks[0])


def _decode_context(batch: OffloadBatch, i: int, layer_id: int) -> PolicyContext:
    return PolicyContext(layer_id, batch.cpu_blocks[i], batch.block_lens[i], False,
                         decode_row=batch.decode_rows[i], decode_len=batch.decode_lens[i])
