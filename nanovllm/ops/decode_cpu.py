"""The CPU path of paged decode attention (:func:`nanovllm.ops.decode_attention` on CPU tensors):
the whole batch in one call of torch's fused CPU flash attention."""

import torch


def check_context_lens(lengths: list[int], max_tokens: int, starts: list[int] | None = None) -> None:
    """ValueError naming the first length outside 0..max_tokens, or the first start outside
    0..its length."""
    for b, length in enumerate(lengths):
        if not 0 <= length <= max_tokens:
            raise ValueError(f"context_lens[{b}]={length} is outside 0..{max_tokens} (max_blocks * block_size)")
    for b, (start, length) in enumerate(zip(starts or [], lengths)):
        if not 0 <= start <= length:
            raise ValueError(f"context_starts[{b}]={start} is outside 0..context_lens[{b}]={length}")


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


def decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse, context_starts=None):
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
    reference."""
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
        k, v = (cache.flatten(0, 1).index_select(0, slots.flatten()).view(batch, longest, heads_kv, dim)
                .transpose(1, 2) for cache in (k_cache, v_cache))
        mask = torch.where(valid, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    else:  # a table per KV head: each head's keys gathered from its own slots
        slots, valid = context_slots(block_tables.flatten(0, 1), starts.repeat_interleave(heads_kv),
                                     context_lens.repeat_interleave(heads_kv), longest, block_size)
        slots, valid = slots.view(batch, heads_kv, longest), valid.view(batch, heads_kv, longest)
        head = torch.arange(heads_kv)[None, :, None]
        k, v = (cache.flatten(0, 1)[slots, head] for cache in (k_cache, v_cache))
        mask = torch.where(valid, 0.0, float("-inf")).to(dtype)[:, :, None, :]
    q_groups = q.unflatten(1, (heads_kv, heads_q // heads_kv)).to(dtype)
    k, v = k.to(dtype), v.to(dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_groups, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    out, lse = out.reshape(batch, heads_q, dim), lse.reshape(batch, heads_q).float()
    empty = ~valid.any(-1)  # [B] or [B, Hkv]: nothing to read; a clamped slot was: zero it
    if empty.any():
        empty = empty[:, None] if empty.dim() == 1 else empty.repeat_interleave(heads_q // heads_kv, 1)
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return (out, lse) if return_lse else out.to(q.dtype)
