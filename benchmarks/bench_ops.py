"""Benchmark of the CUDA attention ops; prints one JSON document.

decode: achieved TB/s of KV read (bytes of every attended key and value over the time of one
decode_attention call, replayed from a CUDA graph as the engine runs it), next to torch's cuDNN
attention over the same KV laid out contiguously. decode_mixed: bench.py's decode batches
(Qwen3-0.6B's 16/8 heads, contexts of 100-1,024 prompt tokens plus the step), at the default split
count and forced ones. decode_fp8: the same call over a bf16 cache and over an fp8 e4m3 one
(bench.py's decode batch at step 300, one and six 128K contexts of Llama-3.1-8B's 32/8 heads), in
us and TB/s of the bytes read. prefill: TFLOP/s of prefill_attention
(4 * head_dim * heads * attended (query, key) pairs).
Usage, from the repository root: python -m benchmarks.bench_ops
"""

import json
import math

import torch
from triton.testing import do_bench

from nanovllm.ops import decode_attention, prefill_attention
from nanovllm.ops.kv_quant import quantize_ref

BLOCK_SIZE = 256
DTYPE = torch.bfloat16


def _paged(contexts, heads_kv, dim, fp8=False):
    """Paged K/V caches over ``contexts`` in a random block order, and their block tables; ``fp8``:
    float8_e4m3fn caches with per-(token, KV head) scales (``nanovllm.ops.kv_quant``), else None."""
    counts = [math.ceil(n / BLOCK_SIZE) for n in contexts]
    num_blocks = sum(counts) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, heads_kv, dim, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, heads_kv, dim, device="cuda", dtype=DTYPE)
    scales = (None, None)
    if fp8:
        (k_cache, k_scale, _), (v_cache, v_scale, _) = (
            quantize_ref(c.flatten(0, 1), torch.float8_e4m3fn) for c in (k_cache, v_cache))
        k_cache, v_cache = (c.view(num_blocks, BLOCK_SIZE, heads_kv, dim) for c in (k_cache, v_cache))
        scales = tuple(s.view(num_blocks, BLOCK_SIZE, heads_kv) for s in (k_scale, v_scale))
    order = torch.randperm(num_blocks, device="cuda").int()
    tables = torch.zeros(len(contexts), max(counts), dtype=torch.int32, device="cuda")
    used = 0
    for b, count in enumerate(counts):
        tables[b, :count] = order[used : used + count]
        used += count
    return k_cache, v_cache, tables, scales


def graph_ms(fn) -> float:
    """Median milliseconds of ``fn`` captured once in a CUDA graph (launch gaps as in the engine's
    decode graphs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def bench_decode(batch, context, heads_q=32, heads_kv=8, dim=128, num_splits=None) -> dict:
    """One decode step of `batch` sequences of `context` tokens each."""
    k_cache, v_cache, tables, _ = _paged([context] * batch, heads_kv, dim)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads_q, dim, device="cuda", dtype=DTYPE)
    ms = graph_ms(lambda: decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, num_splits=num_splits))
    kv_bytes = 2 * batch * context * heads_kv * dim * k_cache.element_size()
    keys = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    values = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    cudnn_ms = do_bench(
        lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q4, keys, values, None, False, 0.0, False, False),
        warmup=25, rep=200, return_mode="median",
    )
    return {
        "op": "decode_attention", "batch": batch, "context": context, "heads_q": heads_q,
        "heads_kv": heads_kv, "head_dim": dim, "block_size": BLOCK_SIZE, "ms": round(ms, 4),
        "kv_tb_per_s": round(kv_bytes / ms / 1e9, 3),
        "cudnn_contiguous_kv_tb_per_s": round(kv_bytes / cudnn_ms / 1e9, 3),
    }


def bench_decode_fp8(contexts, heads_q, heads_kv=8, dim=128) -> dict:
    """One decode step over ``contexts`` with a bf16 cache and with an fp8 e4m3 one (per-token
    scales), in us per call (default split count) and TB/s of the bytes read (keys, values and
    their scales)."""
    result = {"op": "decode_attention", "batch": len(contexts), "mean_context": round(sum(contexts) / len(contexts)),
              "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim}
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    q = torch.randn(len(contexts), heads_q, dim, device="cuda", dtype=DTYPE)
    for name, fp8 in (("bf16", False), ("fp8_e4m3", True)):
        k_cache, v_cache, tables, (k_scale, v_scale) = _paged(contexts, heads_kv, dim, fp8)
        us = 1e3 * graph_ms(lambda: decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5,
                                                     k_scale=k_scale, v_scale=v_scale))
        row_bytes = dim * k_cache.element_size() + (k_scale.element_size() if fp8 else 0)
        result[name] = {"us": round(us, 1), "tb_per_s": round(2 * sum(contexts) * heads_kv * row_bytes / us / 1e6, 3)}
        del k_cache, v_cache
    result["fp8_speedup"] = round(result["bf16"]["us"] / result["fp8_e4m3"]["us"], 3)
    return result


def bench_decode_mixed(batch, step, heads_q=16, heads_kv=8, dim=128) -> dict:
    """A decode step of bench.py at ``step``: ``batch`` sequences of 100-1,024 + step tokens (seed
    0), in us per call for the default split count and 1-8 forced splits."""
    contexts = (torch.randint(100, 1025, (batch,), generator=torch.Generator().manual_seed(0)) + step).tolist()
    k_cache, v_cache, tables, _ = _paged(contexts, heads_kv, dim)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads_q, dim, device="cuda", dtype=DTYPE)
    us = {str(splits): round(1e3 * graph_ms(lambda: decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5,
                                                                     num_splits=splits)), 1)
          for splits in (None, 1, 2, 4, 8)}
    kv_bytes = 2 * sum(contexts) * heads_kv * dim * k_cache.element_size()
    return {"op": "decode_attention", "batch": batch, "step": step, "us_by_splits": us,
            "kv_tb_per_s_default": round(kv_bytes / us["None"] / 1e6, 3)}


def bench_prefill(seqlens_q, prefixes, heads_q=32, heads_kv=8, dim=128) -> dict:
    """prefill_attention over sequences with `seqlens_q` new tokens after `prefixes` cached ones."""
    seqlens_k = [n + p for n, p in zip(seqlens_q, prefixes)]
    k_cache, v_cache, tables, _ = _paged(seqlens_k, heads_kv, dim)
    tokens = sum(seqlens_q)
    q = torch.randn(tokens, heads_q, dim, device="cuda", dtype=DTYPE)
    k = torch.randn(tokens, heads_kv, dim, device="cuda", dtype=DTYPE)
    v = torch.randn(tokens, heads_kv, dim, device="cuda", dtype=DTYPE)
    ms = do_bench(
        lambda: prefill_attention(q, k, v, seqlens_q, seqlens_k, dim**-0.5, k_cache, v_cache, tables),
        warmup=25, rep=200, return_mode="median",
    )
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(seqlens_q, prefixes))
    return {
        "op": "prefill_attention", "seqlens_q": seqlens_q, "prefixes": prefixes, "heads_q": heads_q,
        "heads_kv": heads_kv, "head_dim": dim, "ms": round(ms, 4),
        "tflop_per_s": round(4 * dim * heads_q * pairs / ms / 1e9, 1),
    }


def main() -> None:
    decode = [bench_decode(b, c) for b in (1, 64, 128, 256) for c in (512, 1024, 2048, 4096)]
    decode += [bench_decode(64, 2048, dim=64), bench_decode(64, 2048, heads_q=24)]
    decode_mixed = [bench_decode_mixed(b, s) for b, s in ((251, 100), (128, 500), (48, 800), (16, 900))]
    bench_contexts = (torch.randint(100, 1025, (256,), generator=torch.Generator().manual_seed(0)) + 300).tolist()
    decode_fp8 = [bench_decode_fp8(bench_contexts, 16), bench_decode_fp8([131072], 32), bench_decode_fp8([131072] * 6, 32)]
    prefill = [
        bench_prefill([8192], [0]),
        bench_prefill([2048] * 4, [0] * 4),
        bench_prefill([2048], [6144]),
        bench_prefill([512] * 8, [1536] * 8),
        bench_prefill([300] * 64, [0] * 64),
        bench_prefill([8192], [0], dim=64),
    ]
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "decode": decode, "decode_mixed": decode_mixed, "decode_fp8": decode_fp8, "prefill": prefill},
                     indent=1))


if __name__ == "__main__":
    main()
