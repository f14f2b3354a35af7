"""Throughput benchmark, nano-vLLM's workload: 256 sequences, input and output lengths uniform in
[100, 1024], random token ids, ignore_eos, max_model_len 4096, one warm-up. Prints JSON.

On CUDA it also prints the roofline of the workload: decode is memory-bound, so a decode step
moves at least the weights and the KV of every running sequence through HBM. With all sequences
decoding together from the start (the best schedule), step t reads the weights once and, for each
sequence still generating, its ``prompt + t`` tokens of KV; the bytes of all steps over the
measured HBM bandwidth (a device copy, read + write, per GPU, times the GPUs) bound the time, and
``fraction_of_roofline`` is the measured tok/s over the tok/s that bound allows. Prefill and the
KV writes are left out (a few percent here), so the bound is slightly optimistic.

    python bench.py                      # random-weight Qwen3-0.6B-shaped checkpoint (created once)
    python bench.py --model DIR --compare-hf
    python bench.py --tensor-parallel-size 2                           # spawns rank 1 itself
    python bench.py --data-parallel-size 2                             # spawns replica 1 on GPU 1
    python bench.py --logprobs 5         # every request also returns the top-5 logprobs per token
    python bench.py --no-async-scheduling   # the synchronous loop (default: async scheduling, where supported)
    python bench.py --kv-cache-dtype fp8    # fp8 e4m3 KV (the roofline counts its bytes and scales)
    torchrun --nproc-per-node 2 bench.py --tensor-parallel-size 2      # one process per GPU
    torchrun --standalone --nproc-per-node 2 bench.py --data-parallel-size 2   # 2 replicas, 1 GPU each
    torchrun --standalone --nproc-per-node 4 bench.py --data-parallel-size 2 --tensor-parallel-size 2
"""
import argparse
import json
import os
import time
from random import randint, seed

import torch

from benchmarks.hardware import bandwidths
from nanovllm import LLM, SamplingParams
from nanovllm.kvcache.spec import LayerKVSpec
from nanovllm.utils.dtypes import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from nanovllm.parallel.launch import resolve_launch
from tools.random_checkpoint import cached_random_checkpoint


def workload(num_seqs: int, max_input: int, max_output: int, logprobs: int | None = None):
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output),
                             logprobs=logprobs) for _ in range(num_seqs)]
    return prompts, params


def checkpoint_bytes(model: str, kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """``(weight bytes, KV bytes per token)`` of a HF checkpoint directory: the safetensors files'
    sizes, and keys + values of every layer as the cache stores them (``kv_cache_dtype``: the
    checkpoint's dtype, or fp8 with its scales: ``LayerKVSpec.token_bytes``)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    weights = sum(os.path.getsize(os.path.join(model, name)) for name in os.listdir(model)
                  if name.endswith(".safetensors"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    spec = LayerKVSpec(cfg["num_key_value_heads"], head_dim, dtype,
                       cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype, dtype))
    return weights, cfg["num_hidden_layers"] * spec.token_bytes


def decode_bytes(prompts: list[list[int]], params: list[SamplingParams], weight_bytes: int,
                 kv_bytes_per_token: int) -> int:
    """Bytes the decode steps must read at least (module doc): ``max_tokens - 1`` steps per
    sequence (its first token comes from prefill), step t reading ``len(prompt) + t`` tokens of
    its KV, and the weights once per step."""
    steps = max(p.max_tokens for p in params) - 1
    kv_tokens = sum((p.max_tokens - 1) * len(prompt) + (p.max_tokens - 1) * p.max_tokens // 2
                    for prompt, p in zip(prompts, params))
    return steps * weight_bytes + kv_tokens * kv_bytes_per_token


def roofline(args, prompts, params, result: dict) -> dict:
    """The workload's decode roofline on this machine and the fraction of it reached (CUDA only)."""
    hbm = bandwidths()["hbm_gb_per_s"]
    if hbm != hbm:  # NaN: no CUDA
        return {}
    devices = args.tensor_parallel_size * args.data_parallel_size
    seconds = decode_bytes(prompts, params, *checkpoint_bytes(args.model, args.kv_cache_dtype)) / (hbm * 1e9 * devices)
    bound = result["output_tokens"] / seconds
    return {"hbm_gb_per_s": hbm, "roofline_tok_per_s": round(bound, 1),
            "fraction_of_roofline": round(result["tok_per_s"] / bound, 3)}


def bench_nanovllm(args, prompts, params) -> dict:
    llm = LLM(args.model, max_model_len=4096, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              device=args.device, async_scheduling=args.async_scheduling, enable_cpu_offload=args.enable_cpu_offload,
              kv_cache_dtype=args.kv_cache_dtype)
    llm.generate(["Benchmark: "] * args.data_parallel_size, SamplingParams(), use_tqdm=False)  # every replica
    sync(llm.config.device)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync(llm.config.device)
    seconds = time.perf_counter() - t
    tokens = sum(p.max_tokens for p in params)
    device, async_scheduling = llm.config.device, llm.config.async_scheduling
    gpu_tokens = llm.get_kv_cache_stats()["gpu_tokens"]
    llm.shutdown()
    return {"engine": "nanovllm", "sequences": len(prompts), "output_tokens": tokens,
            "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1), "device": device,
            "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
            "logprobs": args.logprobs, "async_scheduling": async_scheduling, "kv_cache_dtype": args.kv_cache_dtype,
            "gpu_tier_tokens": gpu_tokens}


def bench_hf(args, prompts, params) -> dict:
    """HF transformers' generate on the same prompts (left-padded batches of --hf-batch)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    n = min(args.hf_num_seqs, len(prompts))
    tokens, t = 0, time.perf_counter()
    for i in range(0, n, args.hf_batch):
        batch, ps = prompts[i:i + args.hf_batch], params[i:i + args.hf_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        new = max(p.max_tokens for p in ps)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.6,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        tokens += sum(p.max_tokens for p in ps)
    sync(device)
    seconds = time.perf_counter() - t
    return {"engine": "transformers", "sequences": n, "output_tokens": tokens,
            "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1), "device": device}


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model dir (default: a random-weight Qwen3-0.6B shape)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas sharing the prompts (each of --tensor-parallel-size ranks)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="what the KV cache stores (LLM's kv_cache_dtype)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="force async scheduling on or off (default: the engine's choice, on where "
                             "supported: CUDA, TP=1)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enable-cpu-offload", action="store_true",
                        help="turn on the host tier of the KV cache (nothing spills at these sizes: its cost when unused)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="K",
                        help="SamplingParams(logprobs=K) for every request (default: none)")
    parser.add_argument("--compare-hf", action="store_true", help="also time HF transformers' generate")
    parser.add_argument("--hf-num-seqs", type=int, default=256, help="sequences given to HF")
    parser.add_argument("--hf-batch", type=int, default=64)
    args = parser.parse_args()
    for name in ("max_input_len", "max_output_len"):
        if getattr(args, name) < 100:  # lengths are drawn from [100, max]
            parser.error(f"--{name.replace('_', '-')} must be >= 100, got {getattr(args, name)}")
    if args.model is None:
        args.model = cached_random_checkpoint("qwen3-0.6b")
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.logprobs)
    result = bench_nanovllm(args, prompts, params)
    result.update(roofline(args, prompts, params, result))
    if args.compare_hf:
        result["hf"] = bench_hf(args, prompts, params)
        result["speedup_vs_hf"] = round(result["tok_per_s"] / result["hf"]["tok_per_s"], 2)
    if resolve_launch(args.tensor_parallel_size, args.data_parallel_size).rank == 0:  # under torchrun every rank runs this script
        print(json.dumps(result))


if __name__ == "__main__":
    main()
