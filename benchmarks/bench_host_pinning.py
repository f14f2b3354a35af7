"""Pinning host memory for the host tier: how fast, and whether it stalls the steps; prints JSON.

    python -m benchmarks.bench_host_pinning --gib 8

Measures (CUDA): ``cudaHostAlloc`` of ``--gib`` (torch's ``pin_memory=True``, the old eager host
tier), ``cudaHostRegister`` of a fresh anonymous mapping of the same size in ``--chunk-mib``
ranges, and the time of a fake decode step (``--ops`` small
matmuls then a synchronize) alone and while a ``HostMemory`` pins ``--gib`` in its background
thread (``nanovllm.kvcache.host_memory``, chunks of ``--memory-chunk-mib``): the mean and the longest step of each, so a stall of the steps by pinning shows as a
longer step.
"""
import argparse
import json
import mmap
import statistics
import time

import torch

from nanovllm.kvcache.host_memory import HostMemory, register_host_range, unregister_host_range


def _steps(duration_s: float, ops: int, x: torch.Tensor) -> list[float]:
    times, end = [], time.perf_counter() + duration_s
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(ops):
            x = torch.mm(x, x).clamp_(-1, 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def _summary(times: list[float]) -> dict:
    return {"steps": len(times), "mean_ms": round(statistics.mean(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3), "p99_ms": round(sorted(times)[int(0.99 * len(times))] * 1e3, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--chunk-mib", type=int, default=16, help="bytes per cudaHostRegister call")
    parser.add_argument("--memory-chunk-mib", type=int, default=1024, help="HostMemory's chunk (all layers, K and V)")
    parser.add_argument("--ops", type=int, default=50, help="matmuls per fake step")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    report = {"device": torch.cuda.get_device_name(), "gib": args.gib}
    torch.cuda.init()
    t = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    report["cudaHostAlloc_gb_per_s"] = round(nbytes / (time.perf_counter() - t) / 1e9, 2)
    del pinned
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    step = args.chunk_mib << 20
    t = time.perf_counter()
    for offset in range(0, nbytes, step):
        register_host_range(base + offset, min(step, nbytes - offset))
    report["cudaHostRegister_gb_per_s"] = round(nbytes / (time.perf_counter() - t) / 1e9, 2)
    for offset in range(0, nbytes, step):
        unregister_host_range(base + offset)
    x = torch.randn(256, 256, device="cuda")
    _steps(0.5, args.ops, x)  # warm-up
    report["steps_alone"] = _summary(_steps(2.0, args.ops, x))
    layers = 24
    blocks = max(1, nbytes // (2 * layers * 256 * 2 * 64 * 2))
    memory = HostMemory(layers, blocks, (256, 2, 64), torch.bfloat16, torch.device("cuda"),
                        chunk_bytes=args.memory_chunk_mib << 20)
    t = time.perf_counter()
    memory.start()
    memory.reserve(blocks)  # everything, in the background
    during = []
    while memory.pinned_blocks < blocks:
        during += _steps(0.05, args.ops, x)
    report["pin_in_background_s"] = round(time.perf_counter() - t, 3)
    report["steps_while_pinning"] = _summary(during) if during else None
    memory.release()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
