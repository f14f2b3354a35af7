"""Gather KV pages chosen on the device out of the pinned host tier, per KV head, without a host
round trip.

A page-level sparse policy picks, per decode layer and KV head, pages of ``page_size`` tokens in
both tiers on the device. Copying the host-tier ones with ``cudaMemcpyAsync`` needs their ids on
the host (a sync per layer); instead one kernel reads the ids on the device and copies each picked
(page, KV head) straight out of pinned host memory: with CUDA's unified virtual addressing a
pinned allocation is addressable from the device, so a pinned CPU tensor is passed to the kernel
like a device tensor. Each entry moves one KV head's ``[page_size, D]`` keys and values: the
heads a KV head did not pick are not read.
"""

import torch

from ._triton import block_dim, next_pow2
from .backend import tl, triton, use_triton


def _check_gather_args(src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages) -> None:
    if src_k.dim() != 4 or src_k.shape != src_v.shape:
        raise ValueError(f"src_k and src_v must both be [num_pages, page_size, Hkv, D]; got "
                         f"{tuple(src_k.shape)} and {tuple(src_v.shape)}")
    if dst_k.dim() != 4 or dst_k.shape != dst_v.shape or dst_k.shape[1:] != src_k.shape[1:]:
        raise ValueError(f"dst_k and dst_v must both be [pages, {', '.join(map(str, src_k.shape[1:]))}]; got "
                         f"{tuple(dst_k.shape)} and {tuple(dst_v.shape)}")
    if len({src_k.dtype, src_v.dtype, dst_k.dtype, dst_v.dtype}) != 1:
        raise ValueError(f"src and dst must share one dtype; got {src_k.dtype}, {src_v.dtype}, {dst_k.dtype}, "
                         f"{dst_v.dtype}")
    if src_pages.dim() != 1 or src_pages.shape != dst_pages.shape or heads.shape != src_pages.shape:
        raise ValueError(f"src_pages, heads and dst_pages must all be [n]; got {tuple(src_pages.shape)}, "
                         f"{tuple(heads.shape)} and {tuple(dst_pages.shape)}")
    for name, t in (("src_pages", src_pages), ("heads", heads), ("dst_pages", dst_pages)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != dst_k.device:
            raise ValueError(f"{name} must be on the destination's device {dst_k.device}, got {t.device}")
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last (head_dim) dimension (strides {t.stride()})")
    if src_k.stride() != src_v.stride() or dst_k.stride() != dst_v.stride():
        raise ValueError(f"keys and values must share their strides; got src {src_k.stride()} and {src_v.stride()}, "
                         f"dst {dst_k.stride()} and {dst_v.stride()}")
    if dst_k.is_cuda and not all(t.is_cuda or t.is_pinned() for t in (src_k, src_v)):
        raise ValueError("with CUDA destinations the source must be a CUDA tensor or pinned host memory "
                         "(the kernel reads it through unified virtual addressing)")


def gather_host_pages_ref(src_k: torch.Tensor, src_v: torch.Tensor, src_pages: torch.Tensor, heads: torch.Tensor,
                          dst_k: torch.Tensor, dst_v: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Reference of :func:`gather_host_pages` (same arguments and effect; reads the ids on the
    host)."""
    _check_gather_args(src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages)
    src, head, dst = src_pages.cpu().long(), heads.cpu().long(), dst_pages.cpu().long()
    valid = src >= 0
    src, head, dst = src[valid], head[valid], dst[valid]
    for dst_cache, src_cache in ((dst_k, src_k), (dst_v, src_v)):
        pages = src_cache[src.to(src_cache.device), :, head.to(src_cache.device)]  # [n, page_size, D]
        dst_cache[dst.to(dst_cache.device), :, head.to(dst_cache.device)] = pages.to(dst_cache.device)


@triton.jit
def _gather_host_pages_kernel(src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages, page_size, head_dim,
                              stride_sp, stride_st, stride_sh, stride_dp, stride_dt, stride_dh,
                              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program i: KV head ``heads[i]`` of page ``src_pages[i]`` -> the same head of page
    ``dst_pages[i]``, keys and values; nothing when ``src_pages[i] < 0``."""
    i = tl.program_id(0)
    src = tl.load(src_pages + i).to(tl.int64)
    if src < 0:
        return
    head = tl.load(heads + i).to(tl.int64)
    dst = tl.load(dst_pages + i).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t < page_size)[:, None] & (d < head_dim)[None, :]
    src_off = src * stride_sp + head * stride_sh + t[:, None] * stride_st + d[None, :]
    dst_off = dst * stride_dp + head * stride_dh + t[:, None] * stride_dt + d[None, :]
    # Both loads are issued before either store: a store to dst_k may alias src_v as far as the
    # compiler knows, so a load of src_v after it would wait for it.
    k = tl.load(src_k + src_off, mask=mask)
    v = tl.load(src_v + src_off, mask=mask)
    tl.store(dst_k + dst_off, k, mask=mask)
    tl.store(dst_v + dst_off, v, mask=mask)


def gather_host_pages(src_k: torch.Tensor, src_v: torch.Tensor, src_pages: torch.Tensor, heads: torch.Tensor,
                      dst_k: torch.Tensor, dst_v: torch.Tensor, dst_pages: torch.Tensor,
                      src_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      dst_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Copy KV head ``heads[i]`` of page ``src_pages[i]`` of ``src_k`` / ``src_v`` into the same
    head of page ``dst_pages[i]`` of ``dst_k`` / ``dst_v``, for every ``i`` with ``src_pages[i] >=
    0``, in place.

    Args:
        src_k, src_v: ``[num_pages, page_size, Hkv, D]``, one layer of the host tier viewed as pages:
            on CUDA a pinned CPU tensor (read by the device in place) or a device tensor.
        src_pages: int32/int64 ``[n]`` on the destination's device: page ids, -1 = skip this entry.
        heads: int32/int64 ``[n]``: the KV head of each entry, ``0 <= heads[i] < Hkv``.
        dst_k, dst_v: ``[pages, page_size, Hkv, D]``, same dtype, the destination pages.
        dst_pages: int32/int64 ``[n]``: the page of each entry ((page, head) distinct among copied
            entries).
        src_scales, dst_scales: an fp8 cache's float32 scales ``(k, v)``, ``[num_pages, page_size,
            Hkv]`` and ``[pages, page_size, Hkv]``, gathered with their pages (the same copy over
            head_dim 1, a second launch); both None for another cache.

    The head_dim must be contiguous; keys and values share their strides. Ids are neither read on
    the host nor range-checked on the device (an id out of range is undefined behaviour).

    Raises:
        ValueError: shapes, dtypes or id tensors that disagree, ids off the destination's device,
            an unpinned CPU source for CUDA destinations, a non-contiguous head_dim, scales given
            on one side only.

    CUDA: one Triton launch, a program per entry (a -1 entry returns at once), no host sync. The
    source is read through unified virtual addressing (PCIe), so a pinned CPU source must stay
    alive and unmodified until the kernel ran. Elsewhere (CPU, no Triton): :func:`gather_host_pages_ref`.
    """
    _check_gather_args(src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages)
    if (src_scales is None) != (dst_scales is None):
        raise ValueError("src_scales and dst_scales go together (an fp8 cache's scales), or neither")
    if src_scales is not None:
        gather_host_pages(*(s.unsqueeze(-1) for s in src_scales), src_pages, heads,
                          *(s.unsqueeze(-1) for s in dst_scales), dst_pages)
    if not use_triton(dst_k):
        gather_host_pages_ref(src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages)
        return
    if not src_pages.numel():
        return
    page_size, head_dim = src_k.shape[1], src_k.shape[3]
    _gather_host_pages_kernel[(src_pages.numel(),)](
        src_k, src_v, src_pages, heads, dst_k, dst_v, dst_pages, page_size, head_dim,
        src_k.stride(0), src_k.stride(1), src_k.stride(2), dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
        BLOCK_T=next_pow2(page_size), BLOCK_D=block_dim(head_dim))
