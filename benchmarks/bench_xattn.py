"""Benchmark of XAttention estimation and block-sparse attention on CUDA; prints one JSON document.

At 32K tokens (bf16, Hq 32 / Hkv 8, head_dim 128, 128-token blocks, causal): the time of
xattn_block_scores (stride 8 and 16) and of scores + xattn_select_blocks, each also as a fraction
of dense causal attention (cuDNN through nanovllm.ops.flash_attn_with_lse); and the time of
block-sparse attention at forced densities 0.1 / 0.3 / 0.5 / 1.0 (sink and diagonal blocks kept,
random causally visible blocks added to reach the density; measured density reported) as a
fraction of the dense time, the issue's bound (measured density + 0.1) beside it, and its
throughput on the kept blocks.
Usage, from the repository root: python -m benchmarks.bench_xattn [seq_len >= 256, default 32768]
"""

import json
import sys

import torch
from triton.testing import do_bench

from nanovllm.ops import flash_attn_with_lse
from nanovllm.ops.block_sparse_attention import block_sparse_attention
from nanovllm.ops.xattn_estimate import xattn_block_scores
from nanovllm.ops.xattn_select import block_density, block_layout, xattn_select_blocks

BLOCK = 128
MIN_SEQ = 2 * BLOCK
DTYPE = torch.bfloat16


def _ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def forced_density_mask(heads, seq_q, seq_k, density, seed=0):
    """Sink and diagonal blocks, plus random visible blocks kept with the probability that makes
    the expected density ``density`` (at least the forced blocks' share)."""
    n_q, n_k = -(-seq_q // BLOCK), -(-seq_k // BLOCK)
    visible, forced = block_layout(n_q, n_k, True, BLOCK, seq_q, seq_k, "cuda")
    n_visible, n_forced = int(visible.sum()), int(forced.sum())
    probability = max(density * n_visible - n_forced, 0) / max(n_visible - n_forced, 1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pick = torch.rand((heads, n_q, n_k), device="cuda", generator=gen) < probability
    return (pick & visible) | forced


def main() -> None:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    if seq < MIN_SEQ:
        raise SystemExit(f"seq_len={seq} must be >= {MIN_SEQ} (two {BLOCK}-token blocks)")
    heads_q, heads_kv, dim = 32, 8, 128
    scale = dim**-0.5
    q = torch.randn(seq, heads_q, dim, device="cuda", dtype=DTYPE)
    k = torch.randn(seq, heads_kv, dim, device="cuda", dtype=DTYPE)
    v = torch.randn(seq, heads_kv, dim, device="cuda", dtype=DTYPE)
    dense_ms = _ms(lambda: flash_attn_with_lse(q[None], k[None], v[None], scale, True))
    flops = 4 * dim * heads_q * seq * (seq + 1) / 2
    results = [{"op": "dense_causal_cudnn", "seq": seq, "ms": round(dense_ms, 3),
                "tflops": round(flops / dense_ms / 1e9, 1)}]
    for stride in (8, 16):
        est_ms = _ms(lambda: xattn_block_scores(q, k, stride, BLOCK, scale))
        sel_ms = _ms(lambda: xattn_select_blocks(xattn_block_scores(q, k, stride, BLOCK, scale), 0.9, True, BLOCK))
        results.append({"op": "xattn_block_scores", "seq": seq, "stride": stride, "ms": round(est_ms, 3),
                        "fraction_of_dense": round(est_ms / dense_ms, 4),
                        "with_selection_ms": round(sel_ms, 3),
                        "with_selection_fraction": round(sel_ms / dense_ms, 4)})
    for density in (0.1, 0.3, 0.5, 1.0):
        mask = forced_density_mask(heads_q, seq, seq, density)
        measured = block_density(mask, True, BLOCK, seq, seq)
        sparse_ms = _ms(lambda: block_sparse_attention(q, k, v, mask, BLOCK, scale, True))
        results.append({"op": "block_sparse_attention", "seq": seq, "forced_density": density,
                        "measured_density": round(measured, 4), "ms": round(sparse_ms, 3),
                        "fraction_of_dense": round(sparse_ms / dense_ms, 4),
                        "bound_density_plus_0.1": round(measured + 0.1, 4),
                        "tflops_on_kept": round(flops * measured / sparse_ms / 1e9, 1)})
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "block_size": BLOCK,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
