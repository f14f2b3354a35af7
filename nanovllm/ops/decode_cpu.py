"""Paged decode attention on the CPU: the whole batch in one call of torch's fused attention.

The fast CPU path of :func:`nanovllm.ops.decode_attention` (same arguments and result);
:func:`nanovllm.ops.decode_attention_ref` is the specification both are tested against.
"""
import torch

from ._triton import cdiv


def check_context_lens(lengths: list[int], max_tokens: int) -> None:
    """ValueError naming the first length outside 0..max_tokens."""
    for b, length in enumerate(lengths):
        if not 0 <= length <= max_tokens:
            raise ValueError(f"context_lens[{b}]={length} is outside 0..{max_tokens} (max_blocks * block_size)")


def _context_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, width: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots ``[B, width]`` (int64) of each sequence's tokens 0..width-1 and the mask
    ``[B, width]`` of those below its context length whose table entry is not -1. A slot masked
    out points at the row's token 0 (a row the cache holds), so that padding reads finite values;
    a row with no valid token keeps a clamped, arbitrary slot and must be zeroed by the caller."""
    table = block_tables[:, :cdiv(width, block_size)].long()
    slots = (table[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :width]
    valid = (torch.arange(width) < context_lens[:, None]) & (table >= 0).repeat_interleave(block_size, 1)[:, :width]
    return torch.where(valid, slots, slots[:, :1]).clamp_(min=0), valid


def decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse):
    """:func:`decode_attention` of the whole batch in one fused-attention call (CPU tensors).

    The contexts are gathered into a padded ``[B, Hkv, L, D]`` (L the longest context), and the
    GQA group of each KV head is folded into the query length (``[B, Hkv, group, D]``: a decode
    query is one row, so the group's rows share that head's keys; no K/V repeat). torch's CPU
    flash attention (``_scaled_dot_product_flash_attention_for_cpu``, which returns the LSE) then
    runs once, with an additive mask hiding each sequence's padding. Half inputs are computed in
    float32, like the reference."""
    batch, heads_q, dim = q.shape
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    shortest, longest = (int(n) for n in context_lens.aminmax()) if batch else (0, 0)
    max_tokens = block_tables.shape[-1] * block_size
    if shortest < 0 or longest > max_tokens:
        check_context_lens(context_lens.tolist(), max_tokens)
    if longest == 0:
        out = torch.zeros(q.shape, dtype=dtype)
        lse = torch.full((batch, heads_q), float("-inf"))
        return (out, lse) if return_lse else out.to(q.dtype)
    if block_tables.dim() == 2:
        slots, valid = _context_slots(block_tables, context_lens, longest, block_size)
        k, v = (cache.flatten(0, 1).index_select(0, slots.flatten()).view(batch, longest, heads_kv, dim)
                .transpose(1, 2) for cache in (k_cache, v_cache))
        mask = torch.where(valid, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    else:  # a table per KV head: each head's keys gathered from its own slots
        slots, valid = _context_slots(block_tables.flatten(0, 1), context_lens.repeat_interleave(heads_kv), longest,
                                      block_size)
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


