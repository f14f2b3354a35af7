"""Gather KV blocks chosen on the device out of the pinned host tier, without a host round trip.

QUEST decode picks its host-tier blocks on the device, per layer. Copying them with
``cudaMemcpyAsync`` needs their ids on the host (a sync per layer); instead one kernel reads the
ids on the device and copies the picked blocks straight out of pinned host memory: with CUDA's
unified virtual addressing a pinned allocation is addressable from the device, so a pinned CPU
tensor is passed to the kernel like a device tensor, at close to the copy engine's rate
(``python -m benchmarks.bench_uva_gather``; docs/benchmarks.md, 'Reading picked host blocks').
"""

import torch

from ._triton import cdiv, tl, triton, use_triton

_TILE = 8192
"""Elements per program (one tile of a block), inside the range of tiles that ran at the same rate
(docs/benchmarks.md, 'Reading picked host blocks')."""


def _blocks_contiguous(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether each ``[block_size, Hkv, D]`` block of a ``[n, block_size, Hkv, D]`` tensor is
    contiguous (from the shape and strides alone: a decode layer's check stays off the GPU's path)."""
    expected = 1
    for size, step in zip(reversed(shape[1:]), reversed(stride[1:])):
        if size > 1 and step != expected:
            return False
        expected *= size
    return True


def _check_gather_args(src_k, src_v, src_ids, dst_k, dst_v, dst_ids) -> None:
    if src_k.dim() != 4 or src_k.shape != src_v.shape:
        raise ValueError(f"src_k and src_v must both be [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(src_k.shape)} and {tuple(src_v.shape)}")
    if dst_k.dim() != 4 or dst_k.shape != dst_v.shape or dst_k.shape[1:] != src_k.shape[1:]:
        raise ValueError(f"dst_k and dst_v must both be [rows, {', '.join(map(str, src_k.shape[1:]))}]; got "
                         f"{tuple(dst_k.shape)} and {tuple(dst_v.shape)}")
    if len({src_k.dtype, src_v.dtype, dst_k.dtype, dst_v.dtype}) != 1:
        raise ValueError(f"src and dst must share one dtype; got {src_k.dtype}, {src_v.dtype}, {dst_k.dtype}, "
                         f"{dst_v.dtype}")
    if src_ids.dim() != 1 or src_ids.shape != dst_ids.shape:
        raise ValueError(f"src_ids and dst_ids must both be [n]; got {tuple(src_ids.shape)} and {tuple(dst_ids.shape)}")
    if src_ids.dtype not in (torch.int32, torch.int64) or dst_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"src_ids and dst_ids must be int32 or int64; got {src_ids.dtype} and {dst_ids.dtype}")
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        if not _blocks_contiguous(t.shape, t.stride()):
            raise ValueError(f"{name} must hold each block contiguously (strides {t.stride()})")
    if dst_k.is_cuda and not all(t.is_cuda or t.is_pinned() for t in (src_k, src_v)):
        raise ValueError("with CUDA destinations the source must be a CUDA tensor or pinned host memory "
                         "(the kernel reads it through unified virtual addressing)")
    if src_ids.device != dst_k.device or dst_ids.device != dst_k.device:
        raise ValueError(f"src_ids and dst_ids must be on the destination's device {dst_k.device}; got "
                         f"{src_ids.device} and {dst_ids.device}")
    if src_k.stride(0) != src_v.stride(0) or dst_k.stride(0) != dst_v.stride(0):
        raise ValueError(f"keys and values must share their block stride; got src {src_k.stride(0)} and "
                         f"{src_v.stride(0)}, dst {dst_k.stride(0)} and {dst_v.stride(0)}")


def gather_host_blocks_ref(src_k: torch.Tensor, src_v: torch.Tensor, src_ids: torch.Tensor, dst_k: torch.Tensor,
                           dst_v: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Reference of :func:`gather_host_blocks` (same arguments and effect; reads the ids on the
    host)."""
    _check_gather_args(src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
    src, dst = src_ids.cpu().long(), dst_ids.cpu().long()
    valid = src >= 0
    src, dst = src[valid], dst[valid]
    for dst_cache, src_cache in ((dst_k, src_k), (dst_v, src_v)):
        dst_cache[dst.to(dst_cache.device)] = src_cache[src.to(src_cache.device)].to(dst_cache.device)


@triton.jit
def _gather_host_blocks_kernel(src_k, src_v, src_ids, dst_k, dst_v, dst_ids, block_elems,
                               stride_src, stride_dst, TILE: tl.constexpr):
    """Program (tile, i): tile ``tile`` of block ``src_ids[i]`` -> row ``dst_ids[i]``, keys and
    values; nothing when ``src_ids[i] < 0``."""
    i = tl.program_id(1)
    src = tl.load(src_ids + i).to(tl.int64)
    if src < 0:
        return
    dst = tl.load(dst_ids + i).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < block_elems
    tl.store(dst_k + dst * stride_dst + offs, tl.load(src_k + src * stride_src + offs, mask=mask), mask=mask)
    tl.store(dst_v + dst * stride_dst + offs, tl.load(src_v + src * stride_src + offs, mask=mask), mask=mask)


def gather_host_blocks(src_k: torch.Tensor, src_v: torch.Tensor, src_ids: torch.Tensor, dst_k: torch.Tensor,
                       dst_v: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy blocks ``src_ids[i]`` of ``src_k`` / ``src_v`` into rows ``dst_ids[i]`` of ``dst_k`` /
    ``dst_v``, for every ``i`` with ``src_ids[i] >= 0``, in place.

    Args:
        src_k, src_v: ``[num_blocks, block_size, Hkv, D]``, one layer of the host tier: on CUDA a
            pinned CPU tensor (read by the device in place) or a device tensor.
        src_ids: int32/int64 ``[n]`` on the destination's device: block ids, -1 = skip this entry.
        dst_k, dst_v: ``[rows, block_size, Hkv, D]``, same dtype, the destination rows.
        dst_ids: int32/int64 ``[n]``: the row of each entry (distinct among copied entries).

    Every block must be contiguous (any stride between blocks). Ids are neither read on the host
    nor range-checked on the device (an id out of range is undefined behaviour).

    Raises:
        ValueError: shapes, dtypes or id tensors that disagree, ids off the destination's device,
            an unpinned CPU source for CUDA destinations, or non-contiguous blocks.

    CUDA: one Triton launch, a program per (tile of a block, entry), the programs of a -1 entry
    returning at once; no host sync, so it can be captured in a CUDA graph. The source is read
    through unified virtual addressing (PCIe), so a pinned CPU source must stay alive and
    unmodified until the kernel ran. Elsewhere (CPU, no Triton): :func:`gather_host_blocks_ref`.
    The grid depends only on ``n`` and the block size, and no length is an argument, so one
    compiled variant serves every call of a model.
    """
    _check_gather_args(src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
    if not use_triton(dst_k):
        gather_host_blocks_ref(src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
        return
    block_elems = src_k.shape[1:].numel()
    if not src_ids.numel() or not block_elems:
        return
    _gather_host_blocks_kernel[(cdiv(block_elems, _TILE), src_ids.numel())](
        src_k, src_v, src_ids, dst_k, dst_v, dst_ids, block_elems, src_k.stride(0), dst_k.stride(0), TILE=_TILE)
