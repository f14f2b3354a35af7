"""Can a kernel read pinned host memory in place (UVA) at the copy engine's speed? (issue 14)

QUEST decode waits per layer for its picks on the host before it can issue their loads. A
kernel that reads the picked blocks straight from the pinned host tier (CUDA unified virtual
addressing: a pinned allocation is addressable from the device) needs no host round trip. This
measures, for 5 picked blocks of 16 MiB (one layer of a 4,096-token Llama-3.1-8B block, keys or
values) out of 32 pinned ones: ``cudaMemcpyAsync`` per block, the engine's gather kernel
(:func:`nanovllm.ops.gather_host_blocks`, given the pinned tensor, picks read on the device), and
``torch.index_select`` on a CUDA view of the pinned memory. Each result is checked bit for bit.
Prints one JSON document (GB/s).

    python -m benchmarks.bench_uva_gather      # CUDA only
"""
import json

import torch

from nanovllm.ops import gather_host_blocks

NUM_BLOCKS, BLOCK_ELEMS = 32, 8 * 2**20  # int16 elements: 16 MiB per block
BLOCK_SHAPE = (2, 4096, 8, 128)  # the block as keys and values of [block_size, Hkv, D], as the gather op takes it
PICKS = [3, 9, 17, 22, 30]


class _CudaView:
    """``__cuda_array_interface__`` of a pinned tensor, for a zero-copy CUDA tensor over it."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": "<i2",
                                         "version": 3, "strides": None}


def gb_per_s(fn, dst, expected) -> float:
    fn()
    torch.cuda.synchronize()
    if not torch.equal(dst, expected):
        raise RuntimeError("the gathered blocks differ from the host blocks")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(dst.numel() * 2 * 20 / start.elapsed_time(end) / 1e6, 1)


def main() -> None:
    host = torch.randint(-2**15, 2**15, (NUM_BLOCKS, BLOCK_ELEMS), dtype=torch.int16).pin_memory()
    expected = host[PICKS].cuda()
    dst = torch.empty_like(expected)
    picks = torch.tensor(PICKS, device="cuda")
    view = torch.as_tensor(_CudaView(host), device="cuda")
    results = {"memcpy_async": gb_per_s(lambda: [dst[i].copy_(host[b], non_blocking=True)
                                                  for i, b in enumerate(PICKS)], dst, expected)}
    src, rows = host.view(NUM_BLOCKS, *BLOCK_SHAPE), dst.view(len(PICKS), *BLOCK_SHAPE)
    dst_ids = torch.arange(len(PICKS), device="cuda")
    results["gather_host_blocks"] = gb_per_s(
        lambda: gather_host_blocks(src[:, 0], src[:, 1], picks, rows[:, 0], rows[:, 1], dst_ids), dst, expected)
    results["index_select_on_cuda_view"] = gb_per_s(lambda: torch.index_select(view, 0, picks, out=dst), dst, expected)
    print(json.dumps({"device": torch.cuda.get_device_name(), "block_mib": BLOCK_ELEMS * 2 / 2**20,
                      "blocks": len(PICKS), "gb_per_s": results}))


if __name__ == "__main__":
    main()
