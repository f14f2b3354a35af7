"""How fast does the engine gather a decode step's host pages per KV head? (issue 14)

A policy that chooses decode pages (QUEST) picks, per layer and KV head, pages of ``page_size``
tokens on the device; the pages that live in the pinned host tier are copied by one kernel that
reads the ids on the device and the pinned memory in place through CUDA's unified virtual
addressing (:func:`nanovllm.ops.gather_host_pages`): each entry moves one KV head's ``[page_size,
D]`` keys and values, ``page_size * D * 2 * itemsize`` bytes, rows ``Hkv * D`` elements apart on
the host. This measures, for each page size (16, 32, 64) and head_dim (64, 128), one layer of a
``--host-tokens``-token host tier of ``--kv-heads`` KV heads (bfloat16) of which every KV head
picks ``--budget`` tokens of distinct random pages, the gather into staging pages as the engine
lays them out (each head fills its own head of the same pages):

- ``gather_host_pages``: the engine's kernel, ids on the device;
- ``index_on_cuda_view``: torch indexing of a zero-copy CUDA view of the pinned memory (reads it in
  place too, ids on the device), then a scatter into the staging pages;
- ``memcpy2d_per_entry``: one ``cudaMemcpy2DAsync`` per (page, KV head), keys and values
  (``nanovllm.kvcache.memcpy2d``; the ids must be on the host, which costs a sync per layer);
- ``contiguous_h2d``: one pinned copy of as many contiguous bytes: the link's ceiling.

Each result is checked bit for bit against :func:`nanovllm.ops.gather_host_pages_ref`. Prints one
JSON document (GB/s of KV moved).

    python -m benchmarks.bench_uva_gather                       # CUDA
    python -m benchmarks.bench_uva_gather --device cpu --host-tokens 8192 --budget 256   # the harness on CPU
"""
import argparse
import json
import time

import torch

from nanovllm.kvcache.memcpy2d import memcpy_2d_async
from nanovllm.ops import gather_host_pages, gather_host_pages_ref
from nanovllm.sparse import DEFAULT_TOKEN_BUDGET

DTYPE = torch.bfloat16


class _CudaView:
    """``__cuda_array_interface__`` of a pinned int16 tensor, for a zero-copy CUDA tensor over it."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": "<i2",
                                         "version": 3, "strides": None}


def _seconds(fn, cuda: bool, iters: int) -> float:
    """Mean seconds of ``fn`` over ``iters`` calls (after the checked first one)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure(page: int, head_dim: int, kv_heads: int, host_tokens: int, budget: int, device: torch.device,
            iters: int, seed: int = 0) -> dict:
    """GB/s of each method (module doc) at one page size and head_dim."""
    cuda = device.type == "cuda"
    num_pages, picks = host_tokens // page, budget // page
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, page, kv_heads, head_dim)
    src_k, src_v = (torch.randn(shape, generator=g).to(DTYPE).pin_memory() if cuda else
                    torch.randn(shape, generator=g).to(DTYPE) for _ in range(2))
    # per KV head, `picks` distinct pages; head h's i-th pick goes to head h of staging page i
    src_pages = torch.stack([torch.randperm(num_pages, generator=g)[:picks] for _ in range(kv_heads)]).flatten()
    heads = torch.arange(kv_heads).repeat_interleave(picks)
    dst_pages = torch.arange(picks).repeat(kv_heads)
    expected = [torch.zeros(picks, page, kv_heads, head_dim, dtype=DTYPE) for _ in range(2)]
    gather_host_pages_ref(src_k, src_v, src_pages, heads, *expected, dst_pages)
    dst_k, dst_v = (torch.zeros(picks, page, kv_heads, head_dim, dtype=DTYPE, device=device) for _ in range(2))
    ids = [t.to(device) for t in (src_pages, heads, dst_pages)]
    nbytes = 2 * src_pages.numel() * page * head_dim * DTYPE.itemsize

    def uva():
        gather_host_pages(src_k, src_v, ids[0], ids[1], dst_k, dst_v, ids[2])

    if cuda:
        views = [torch.as_tensor(_CudaView(t.view(torch.int16)), device=device) for t in (src_k, src_v)]
    else:
        views = [t.view(torch.int16) for t in (src_k, src_v)]

    def indexed():
        for view, dst in ((views[0], dst_k), (views[1], dst_v)):
            dst.view(torch.int16)[ids[2], :, ids[1]] = view[ids[0], :, ids[1]]

    pitch = kv_heads * head_dim * DTYPE.itemsize
    entries = list(zip(src_pages.tolist(), heads.tolist(), dst_pages.tolist()))
    kind = "h2d" if cuda else "h2h"

    def memcpy():
        for s, h, d in entries:
            for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                memcpy_2d_async(dst[d, 0, h], src[s, 0, h], pitch, pitch, head_dim * DTYPE.itemsize, page, kind)

    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    results = {}
    for name, fn in (("gather_host_pages", uva), ("index_on_cuda_view", indexed), ("memcpy2d_per_entry", memcpy)):
        dst_k.zero_()
        dst_v.zero_()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if not (torch.equal(dst_k.cpu(), expected[0]) and torch.equal(dst_v.cpu(), expected[1])):
            raise RuntimeError(f"{name}: the gathered pages differ from the host pages (page {page}, D {head_dim})")
        results[name] = round(nbytes / _seconds(fn, cuda, iters) / 1e9, 2)
    flat_dev.copy_(flat_host, non_blocking=True)
    results["contiguous_h2d"] = round(nbytes / _seconds(lambda: flat_dev.copy_(flat_host, non_blocking=True), cuda,
                                                        iters) / 1e9, 2)
    return {"page_size": page, "head_dim": head_dim, "entries": src_pages.numel(),
            "entry_bytes": 2 * page * head_dim * DTYPE.itemsize, "mib_per_gather": round(nbytes / 2**20, 3),
            "gb_per_s": results}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-sizes", type=_ints, default=[16, 32, 64])
    p.add_argument("--head-dims", type=_ints, default=[64, 128])
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the layer (default 8, Llama-3.1-8B's)")
    p.add_argument("--host-tokens", type=int, default=131072, help="tokens of the host tier's layer (default 128K)")
    p.add_argument("--budget", type=int, default=DEFAULT_TOKEN_BUDGET,
                   help=f"tokens each KV head picks (default {DEFAULT_TOKEN_BUDGET})")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the same harness with the torch reference gather (checks it, measures nothing useful)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available (use --device cpu to run the harness on the CPU)")
    if min(args.page_sizes + args.head_dims + [args.kv_heads, args.iters]) < 1:
        p.error("page sizes, head dims, --kv-heads and --iters must be >= 1")
    for page in args.page_sizes:
        if args.budget < page or args.host_tokens < args.budget:
            p.error(f"need page size {page} <= --budget {args.budget} <= --host-tokens {args.host_tokens}")
    device = torch.device(args.device)
    results = [measure(page, dim, args.kv_heads, args.host_tokens, args.budget, device, args.iters)
               for dim in args.head_dims for page in args.page_sizes]
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "dtype": str(DTYPE).removeprefix("torch."), "kv_heads": args.kv_heads,
                      "host_tokens": args.host_tokens, "budget_tokens_per_head": args.budget, "results": results}))


if __name__ == "__main__":
    main()
