"""Decode GEMMs of bench.py's model (Qwen3-0.6B, bf16): cuBLAS against Triton tiles (issue 16).

``y [M, N] = x [M, K] @ w [N, K]^T`` for the layer GEMMs (qkv, o_proj, gate_up, down) and the LM
head at decode batch sizes M. Each candidate is timed inside a CUDA graph of 28 calls (one per
layer; the median replay of ``bench_ops.graph_ms``), cycling through 4 weight copies so that the weights come from HBM, not L2, as in a
decode step. The Triton candidate is a plain tiled GEMM (tiles ``BM x BN``, ``BK`` = 128,
optional split-K through float32 atomics; its zeroing and cast are timed with it), each tile
checked against ``torch.nn.functional.linear`` before it is timed. Prints one JSON document:
per GEMM and M, cuBLAS us, the best Triton tile and its us, and the HBM floor (weight bytes at
4.2 TB/s).

    python -m benchmarks.bench_decode_gemms      # CUDA only
"""
import itertools
import json

import torch
import triton
import triton.language as tl

from benchmarks.bench_ops import graph_ms

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
BATCHES = (8, 32, 64, 128, 256)
LAYERS = 28
HBM_BYTES_PER_US = 4.2e6


@triton.jit
def _gemm_kernel(x, w, out, acc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    k_per_split = K // SPLIT
    for k0 in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BK):
        a = tl.load(x + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(w + rn[:, None] * K + (k0 + rk)[None, :])
        total = tl.dot(a, tl.trans(b), total)
    if SPLIT == 1:
        tl.store(out + rm[:, None] * N + rn[None, :], total.to(out.dtype.element_ty), mask=rm[:, None] < M)
    else:
        tl.atomic_add(acc + rm[:, None] * N + rn[None, :], total, mask=rm[:, None] < M, sem="relaxed")


def triton_gemm(x, w, out, acc, bm, bn, split):
    """``out = x @ w.T`` with one tile choice (``acc``: float32 scratch for split-K)."""
    m, k = x.shape
    n = w.shape[0]
    if split > 1:
        acc.zero_()
    _gemm_kernel[(n // bn, triton.cdiv(m, bm), split)](x, w, out, acc, m, n, k, BM=bm, BN=bn, BK=128, SPLIT=split,
                                                       num_warps=4, num_stages=4)
    if split > 1:
        out.copy_(acc)


def graph_us(fn) -> float:
    """Microseconds per call of ``fn`` inside a CUDA graph of ``LAYERS`` calls."""
    return graph_ms(lambda: [fn() for _ in range(LAYERS)]) * 1e3 / LAYERS


def best_triton(x, weights, n) -> dict:
    m, k = x.shape
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    cycle = itertools.cycle(weights)
    best = None
    for bm, bn, split in itertools.product((16, 64, 128), (32, 64, 128), (1, 2, 4)):
        if bm > max(16, triton.next_power_of_2(m)) or (k // split) % 128:
            continue
        try:
            triton_gemm(x, weights[0], out, acc, bm, bn, split)
        except triton.runtime.errors.OutOfResources:  # the tile's pipeline does not fit in shared memory
            continue
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, weights[0]).float(), rtol=2e-2, atol=2e-2)
        us = graph_us(lambda: triton_gemm(x, next(cycle), out, acc, bm, bn, split))
        if best is None or us < best["us"]:
            best = {"us": round(us, 2), "BM": bm, "BN": bn, "split_k": split}
    return best


def main() -> None:
    results = {}
    for name, (n, k) in SHAPES.items():
        copies = 4 if name != "lm_head" else 1
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(copies)]
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cycle = itertools.cycle(weights)
            row = {"hbm_floor_us": round(n * k * 2 / HBM_BYTES_PER_US, 2),
                   "cublas_us": round(graph_us(lambda: torch.nn.functional.linear(x, next(cycle))), 2)}
            if name != "lm_head" and m >= 32:
                row["triton_best"] = best_triton(x, weights, n)
            results[f"{name}_M{m}"] = row
    print(json.dumps({"device": torch.cuda.get_device_name(), "gemms": results}))


if __name__ == "__main__":
    main()
