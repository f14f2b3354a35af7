"""Scatter new tokens' keys and values into the paged KV cache."""

import torch

from ._triton import cdiv, check_head_dim, next_pow2, tl, triton, use_triton


def check_store_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    """ValueError unless :func:`store_kvcache` takes these arguments (shapes, strides, head_dim)."""
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


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of :func:`store_kvcache` (same arguments); indexes with a host sync."""
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot  # a tensor mask, not a scalar
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & (slots >= 0)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its slot of the paged KV cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the cache's);
            rows may be strided (e.g. views of a fused qkv projection).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous last dim.
        slot_mapping: int32/int64 ``[num_tokens]``; token t goes to flat slot
            ``block_id * block_size + offset``; ``-1`` skips the token (padding).

    Raises:
        ValueError: mismatched shapes, a non-contiguous cache head_dim, head_dim outside 1..256,
            a slot_mapping that is not int32/int64, tensors that are not floating point; off
            CUDA, a slot outside -1..num_blocks * block_size - 1.

    CUDA tensors use a Triton kernel (one program per token, no host sync, so it is CUDA-graph
    capturable); slots are not range-checked there: a slot >= num_blocks * block_size is
    undefined behaviour. CPU: two ``index_copy_`` into the caches viewed as slot rows when no
    slot is -1 and the caches' block and offset dimensions merge into one; otherwise, and on
    other devices, :func:`store_kvcache_ref`.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if not use_triton(key):
        padded = _check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
        if padded or not (key.device.type == "cpu" and _store_cpu(key, value, k_cache, v_cache, slot_mapping)):
            store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


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
    """``cache [num_blocks, block_size, H, D]`` viewed as slot rows ``[num_blocks * block_size,
    H, D]`` (sharing its storage), or None when the block and offset strides do not merge."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1):
        return None
    return cache.view(-1, *cache.shape[2:])


def _store_cpu(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """CPU :func:`store_kvcache` of slots without padding: one ``index_copy_`` per cache (a few
    ops instead of the reference's masked indexing). False, with nothing written, when the caches'
    block and offset dimensions do not merge."""
    rows = [_slot_rows(k_cache), _slot_rows(v_cache)]
    if any(r is None for r in rows):
        return False
    slots = slot_mapping.long()
    for dst, src in zip(rows, (key, value)):
        dst.index_copy_(0, slots, src.to(dst.dtype))
    return True


def gather_kvcache(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Copy one sequence's first ``num_tokens`` cached rows out of the paged cache.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a k or v cache).
        block_table: int32/int64 ``[max_blocks]``, the sequence's block ids in order; only the
            first ``ceil(num_tokens / block_size)`` entries are read.
        num_tokens: rows to return (>= 0).

    Returns:
        ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype (a new tensor).
    """
    blocks = block_table[: cdiv(num_tokens, cache.shape[1])]
    return cache.index_select(0, blocks).flatten(0, 1)[:num_tokens]
