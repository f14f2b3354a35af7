"""Benchmark of strided host<->device copies (nanovllm.kvcache.memcpy2d); prints one JSON document.

contiguous: torch ``copy_`` of one large pinned tensor, H2D and D2H (the pinned-memory bandwidth).
layouts: the CPU-offload layout of Llama-3.1-8B keys (32 layers, 8 kv heads, head_dim 128, bf16):
host cache ``[32, num_blocks, block_tokens, 8, 128]`` layer-major, GPU buffer
``[32, block_tokens, 8, 128]``. One copy moves one block of every layer (height 32, width = pitch
on the GPU = block bytes, host pitch = num_blocks * block bytes):

- ``memcpy2d``: ``memcpy_2d_async`` (cudaMemcpy2DAsync through the extension);
- ``torch_strided``: ``buf.copy_(host[:, b], non_blocking=True)``, the strided torch copy;
- ``torch_rows``: the fallback, one contiguous torch copy per layer;
- ``ratio_vs_contiguous``: memcpy2d GB/s over contiguous GB/s, per direction (target >= 0.95);
- ``concurrent``: H2D and D2H memcpy2d at once on two streams (aggregate GB/s).

Timing: CUDA events around a batch of copies on one stream, warm-up first, median of repeats.
GB/s are 1e9 bytes per second. Usage: python benchmarks/bench_sgdma.py [--quick]
"""

import argparse
import json
import statistics

import torch

from nanovllm.kvcache import memcpy2d as sgdma
from nanovllm.kvcache.memcpy2d import memcpy_2d_async, memcpy_2d_torch

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
TARGET = 0.95


def _time_gbps(fn, nbytes: int, repeats: int, warmup: int = 2) -> float:
    """Median GB/s of ``fn()`` (queues ``nbytes`` of copies on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def bench_contiguous(nbytes: int, repeats: int) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _time_gbps(lambda: dev.copy_(host, non_blocking=True), nbytes, repeats)
    d2h = _time_gbps(lambda: host.copy_(dev, non_blocking=True), nbytes, repeats)
    return {"bytes": nbytes, "h2d_gbps": h2d, "d2h_gbps": d2h}


def bench_layout(block_tokens: int, num_blocks: int, repeats: int, contiguous: dict,
                 strided_blocks: int) -> dict:
    host = torch.empty(LAYERS, num_blocks, block_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, pin_memory=True)
    host.view(torch.uint8).random_(0, 256)
    buf = torch.empty(LAYERS, block_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    block_bytes = block_tokens * KV_HEADS * HEAD_DIM * host.element_size()
    host_pitch = num_blocks * block_bytes
    per_copy = LAYERS * block_bytes

    def memcpy2d(direction, blocks):
        def run():
            for b in blocks:
                if direction == "h2d":
                    memcpy_2d_async(buf, host[0, b], block_bytes, host_pitch, block_bytes, LAYERS, "h2d")
                else:
                    memcpy_2d_async(host[0, b], buf, host_pitch, block_bytes, block_bytes, LAYERS, "d2h")
        return run

    def strided(direction, blocks):
        def run():
            for b in blocks:
                if direction == "h2d":
                    buf.copy_(host[:, b], non_blocking=True)
                else:
                    host[:, b].copy_(buf, non_blocking=True)
        return run

    def rows(direction, blocks):
        def run():
            for b in blocks:
                if direction == "h2d":
                    memcpy_2d_torch(buf, host[0, b], block_bytes, host_pitch, block_bytes, LAYERS)
                else:
                    memcpy_2d_torch(host[0, b], buf, host_pitch, block_bytes, block_bytes, LAYERS)
        return run

    all_blocks = list(range(num_blocks))
    few = all_blocks[:strided_blocks]
    out = {
        "block_tokens": block_tokens, "layers": LAYERS, "num_blocks": num_blocks,
        "block_bytes": block_bytes, "host_pitch": host_pitch, "bytes_per_copy": per_copy,
        "memcpy2d": {d: _time_gbps(memcpy2d(d, all_blocks), per_copy * num_blocks, repeats)
                     for d in ("h2d", "d2h")},
        "torch_rows": {d: _time_gbps(rows(d, all_blocks), per_copy * num_blocks, repeats)
                       for d in ("h2d", "d2h")},
        "torch_strided": {d: _time_gbps(strided(d, few), per_copy * len(few), 3, warmup=1)
                          for d in ("h2d", "d2h")},
    }
    ratio = {d: round(out["memcpy2d"][d] / contiguous[f"{d}_gbps"], 3) for d in ("h2d", "d2h")}
    out["ratio_vs_contiguous"] = ratio
    out["meets_target"] = all(r >= TARGET for r in ratio.values())

    # both directions at once: loads into buf on one stream, offloads of a second buffer on another
    buf2 = torch.empty_like(buf)
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        s_in.wait_stream(cur)
        s_out.wait_stream(cur)
        for b in all_blocks:
            memcpy_2d_async(buf, host[0, b], block_bytes, host_pitch, block_bytes, LAYERS, "h2d", stream=s_in)
            memcpy_2d_async(host[0, (b + 1) % num_blocks], buf2, host_pitch, block_bytes, block_bytes,
                            LAYERS, "d2h", stream=s_out)
        cur.wait_stream(s_in)
        cur.wait_stream(s_out)

    out["concurrent_gbps"] = _time_gbps(both, 2 * per_copy * num_blocks, repeats)
    del host
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller buffers")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sgdma needs a CUDA GPU")
    repeats = 3 if args.quick else 9
    backend = sgdma.backend()  # may build the extension (timed separately by the log)
    contiguous = bench_contiguous((256 if args.quick else 1024) << 20, repeats)
    layouts = [
        # (block tokens, host blocks): 2 MiB and 8 MiB per layer-block; 2 GiB of pinned host each
        bench_layout(1024, 8 if args.quick else 32, repeats, contiguous, strided_blocks=1),
        bench_layout(4096, 2 if args.quick else 8, repeats, contiguous, strided_blocks=1),
    ]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backend": backend,
        "load_error": sgdma.load_error(),
        "contiguous": contiguous,
        "layouts": layouts,
        "target_ratio": TARGET,
        "meets_target": all(l["meets_target"] for l in layouts),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
