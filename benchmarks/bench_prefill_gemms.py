"""GEMM throughput of one Llama-3.1-8B layer at prefill chunk sizes, alone and beside a host copy.

Offload prefill runs its GEMMs on chunks of one KV block (4,096 tokens in bench_offload.py) while
the copy engine streams KV; GPU-only prefill runs 16,384-token chunks. This measures whether the
chunk size or a concurrent pinned H2D copy (64 MiB enqueued on another stream before every
timed GEMM; do_bench synchronises the device, so copies queued once would drain before timing) slows the layer's
four GEMMs (qkv, o, gate_up, down; bf16, ``torch.nn.functional.linear``). Prints one JSON object
of TFLOP/s per GEMM and per layer. Usage: python -m benchmarks.bench_prefill_gemms
"""

import json

import torch
from triton.testing import do_bench

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
"""(in_features, out_features) of Llama-3.1-8B's layer GEMMs."""
CHUNKS = (4096, 16384)
COPY_BYTES = 64 << 20
"""Pinned H2D bytes enqueued on a side stream before every timed GEMM (about 1.2 ms at 55 GB/s,
longer than any GEMM here, so the copy engine stays busy while they run)."""


def layer_tflops(tag: str, results: dict, before=None) -> None:
    """TFLOP/s of each GEMM and of the layer at every chunk size; ``before()``, when given, runs
    before every timed GEMM (it enqueues the concurrent copy)."""
    for rows in CHUNKS:
        total_ms = total_flops = 0.0
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

            def gemm():
                if before is not None:
                    before()
                return torch.nn.functional.linear(x, w)

            ms = do_bench(gemm, warmup=10, rep=50, return_mode="median")
            flops = 2 * rows * k * n
            results[f"{tag}.m{rows}.{name}"] = round(flops / ms / 1e9, 1)
            total_ms, total_flops = total_ms + ms, total_flops + flops
        results[f"{tag}.m{rows}.layer_tflops"] = round(total_flops / total_ms / 1e9, 1)


def main() -> None:
    results = {"device": torch.cuda.get_device_name()}
    layer_tflops("alone", results)
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    copies = torch.cuda.Stream()

    def enqueue_copy():
        with torch.cuda.stream(copies):
            device.copy_(host, non_blocking=True)

    layer_tflops("with_h2d", results, enqueue_copy)
    torch.cuda.synchronize()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
