"""The CPU path of paged decode attention (:func:`nanovllm.ops.decode_attention` on CPU tensors):
the whole batch in one call of torch's fused CPU flash attention; and the argument checks of
every path."""

import torch

from ._triton import check_gqa, check_head_dim
from .kv_quant import check_scales, dequantize

MAX_BATCH = 65535
"""Largest decode batch: the batch is the CUDA kernel's grid's second dimension, which CUDA caps at 65535."""


def check_context_lens(lengths: list[int], max_tokens: int, starts: list[int] | None = None) -> None:
    """ValueError naming the first length outside 0..max_tokens, or the first start outside
    0..its length."""
    for b, length in enumerate(lengths):
        if not 0 <= length <= max_tokens:
            raise ValueError(f"context_lens[{b}]={length} is outside 0..{max_tokens} (max_blocks * block_size)")
    for b, (start, length) in enumerate(zip(starts or [], lengths)):
        if not 0 <= start <= length:
            raise ValueError(f"context_starts[{b}]={start} is outside 0..context_lens[{b}]={length}")


def check_decode_args(q, k_cache, v_cache, block_tables, context_lens, context_starts=None, k_scale=None,
                       v_scale=None) -> None:
    """ValueError unless :func:`nanovllm.ops.decode_attention` takes these arguments (shapes,
    strides, dtypes, scales exactly with fp8 caches); lengths are checked by the paths that read
    them on the host."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D]; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim={q.shape[2]} != cache head_dim={k_cache.shape[3]}")
    check_gqa(q.shape[1], k_cache.shape[2])
    check_head_dim(q.shape[2])
    if q.shape[0] > MAX_BATCH:
        raise ValueError(f"decode batch of {q.shape[0]} sequences exceeds {MAX_BATCH} (the CUDA grid's y limit)")
    per_head = block_tables.dim() == 3
    if block_tables.dim() not in (2, 3) or block_tables.shape[0] != q.shape[0] or (
            per_head and block_tables.shape[1] != k_cache.shape[2]):
        raise ValueError(f"block_tables must be [B={q.shape[0]}, max_blocks] or, per KV head, [B={q.shape[0]}, "
                         f"Hkv={k_cache.shape[2]}, max_blocks]; got {tuple(block_tables.shape)}")
    if context_lens.shape != (q.shape[0],):
        raise ValueError(f"context_lens must be [B={q.shape[0]}]; got {tuple(context_lens.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    if context_starts is not None and (context_starts.shape != (q.shape[0],) or context_starts.dtype not in (
            torch.int32, torch.int64)):
        raise ValueError(f"context_starts must be int32 or int64 [B={q.shape[0]}]; got {context_starts.dtype} "
                         f"{tuple(context_starts.shape)}")
    check_scales(k_cache, k_scale, "k_scale")
    check_scales(v_cache, v_scale, "v_scale")
    if k_scale is not None and (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1):
        raise ValueError(f"k_scale and v_scale must share their strides, the KV head's contiguous; got "
                         f"{k_scale.stride()} and {v_scale.stride()}")


def context_slots(block_tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots ``[B, width]`` (int64) of each row's tokens ``starts[b] ..
    starts[b] + width - 1`` (indices into its block table's tokens) and the mask ``[B, width]`` of
    those below its context length whose table entry is not -1. A masked slot points at the row's
    first token (a row the cache holds), so that padding reads finite values; a row with no token
    to read keeps a clamped, arbitrary slot and must be zeroed by the caller."""
    tokens = starts.long()[:, None] + torch.arange(width)
    valid = tokens < lens[:, None]
    tokens = torch.where(valid, tokens, tokens[:, :1])
    blocks = block_tables.long().gather(1, (tokens // block_size).clamp_(max=block_tables.shape[1] - 1))
    valid &= blocks >= 0  # a -1 table entry reads nothing
    return (blocks * block_size + tokens % block_size).clamp_(min=0), valid


def decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse, context_starts=None,
               k_scale=None, v_scale=None):
    """:func:`nanovllm.ops.decode_attention` of the whole batch in one fused-attention call (CPU
    tensors; arguments checked by the caller, lengths and starts range-checked here).

    Each row's tokens ``context_starts[b] .. context_lens[b] - 1`` (from 0 without starts; per KV
    head with a table per head; -1 table entries masked) are
    gathered into a padded ``[B, Hkv, L, D]`` (L the most tokens a row reads: the tokens before a
    row's start are never gathered), and the GQA group of each KV head is folded into the query
    length (``[B, Hkv, group, D]``: a decode query is one row, so the group's rows share that
    head's keys; no K/V repeat). torch's CPU flash attention
    (``_scaled_dot_product_flash_attention_for_cpu``, which returns the LSE) then runs once, with
    an additive mask hiding each row's padding. Half inputs are computed in float32, like the
    reference; fp8 keys and values (``k_scale``, ``v_scale`` given) are dequantized as gathered."""
    batch, heads_q, dim = q.shape
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    max_tokens = block_tables.shape[-1] * block_size
    starts = torch.zeros_like(context_lens) if context_starts is None else context_starts.to(context_lens.dtype)
    spans = context_lens - starts
    shortest, longest = (int(n) for n in spans.aminmax()) if batch else (0, 0)
    low, high = (int(n) for n in context_lens.aminmax()) if batch else (0, 0)
    if low < 0 or high > max_tokens or shortest < 0 or (context_starts is not None and int(starts.min()) < 0):
        check_context_lens(context_lens.tolist(), max_tokens, None if context_starts is None else starts.tolist())
    if longest == 0:
        out = torch.zeros(q.shape, dtype=dtype)
        lse = torch.full((batch, heads_q), float("-inf"))
        return (out, lse) if return_lse else out.to(q.dtype)
    if block_tables.dim() == 2:
        slots, valid = context_slots(block_tables, starts, context_lens, longest, block_size)
        k, v = (dequantize(cache.flatten(0, 1).index_select(0, slots.flatten()),
                           None if sc is None else sc.flatten(0, 1).index_select(0, slots.flatten()), dtype)
                .view(batch, longest, heads_kv, dim).transpose(1, 2)
                for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
        mask = torch.where(valid, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    else:  # a table per KV head: each head's keys gathered from its own slots
        slots, valid = context_slots(block_tables.flatten(0, 1), starts.repeat_interleave(heads_kv),
                                     context_lens.repeat_interleave(heads_kv), longest, block_size)
        slots, valid = slots.view(batch, heads_kv, longest), valid.view(batch, heads_kv, longest)
        head = torch.arange(heads_kv)[None, :, None]
        k, v = (dequantize(cache.flatten(0, 1)[slots, head], None if sc is None else sc.flatten(0, 1)[slots, head],
                           dtype) for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
        mask = torch.where(valid, 0.0, float("-inf")).to(dtype)[:, :, None, :]
    q_groups = q.unflatten(1, (heads_kv, heads_q // heads_kv)).to(dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_groups, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    out, lse = out.reshape(batch, heads_q, dim), lse.reshape(batch, heads_q).float()
    empty = ~valid.any(-1)  # [B] or [B, Hkv]: nothing to read; a clamped slot was: zero it
    if empty.any():
        empty = empty[:, None] if empty.dim() == 1 else empty.repeat_interleave(heads_q // heads_kv, 1)
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return (out, lse) if return_lse else out.to(q.dtype)
