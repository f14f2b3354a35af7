"""One long sequence with the KV cache offloaded to host memory and without; prints JSON.

    python bench_offload.py --input-len 32768 --num-gpu-blocks 4 --block-size 4096
    python bench_offload.py --sparse-policy XATTN_BSA --sparse-threshold 0.9

Default model: a random-weight checkpoint with Llama-3.1-8B's shape (created once under
$NANOVLLM_CACHE). Reported per mode: prefill tok/s, TTFT, decode tok/s, TPOT; for offload also
bytes moved H2D / D2H, achieved decode GB/s, and decode tok/s as a fraction of the PCIe bound
(pinned bandwidth measured here / KV bytes read per token). The sparse policy applies to both
modes (QUEST only changes offload decode; XATTN_BSA is block-sparse prefill in both); each mode
reports its ``LLM.get_sparse_stats()`` of the measured request (``sparse_stats``).
"""
import argparse
import gc
import json
import os
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import make_random_checkpoint


def pinned_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Host-to-device GB/s of one large pinned copy (median of 5)."""
    if device != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / sorted(times[1:])[2] / 1e9


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _stats_summary(stats: dict) -> dict:
    """get_sparse_stats() without the per-layer lists (kept short for the JSON line)."""
    return {"policy": stats["policy"], **{phase: {k: v for k, v in stats[phase].items() if k != "per_layer"}
                                          for phase in ("prefill", "decode")}}


def run_one(args, offload: bool) -> dict:
    kwargs = dict(max_model_len=args.input_len + args.decode_tokens + 16, kvcache_block_size=args.block_size,
                  max_num_seqs=1, enforce_eager=args.enforce_eager, device=args.device,
                  sparse_policy=args.sparse_policy, sparse_threshold=args.sparse_threshold,
                  sparse_topk_blocks=args.sparse_topk_blocks, sparse_threshold_blocks=args.sparse_threshold_blocks)
    if offload:
        kwargs.update(enable_cpu_offload=True, num_gpu_blocks=args.num_gpu_blocks,
                      num_cpu_kvcache_blocks=-(-kwargs["max_model_len"] // args.block_size))
    else:
        kwargs.update(max_num_batched_tokens=args.max_num_batched_tokens)
    llm = LLM(args.model, **kwargs)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 30000, (args.input_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompt[:args.block_size]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    engine = getattr(llm.model_runner, "offload_engine", None)
    if engine is not None:
        engine.reset()
    llm.reset_sparse_stats()
    llm.add_request(prompt, params)
    sync()
    t0 = time.perf_counter()
    while not llm.scheduler.running:
        llm.step()
    sync()
    ttft = time.perf_counter() - t0
    h2d_prefill = engine.bytes_h2d if engine else 0
    t1 = time.perf_counter()
    finished = []
    while not llm.is_finished():
        finished += llm.step()[0]
    sync()
    decode_s = time.perf_counter() - t1
    steps = args.decode_tokens - 1
    result = {"mode": "offload" if offload else "gpu", "input_len": args.input_len,
              "prefill_tok_per_s": round(args.input_len / ttft, 1), "ttft_s": round(ttft, 3),
              "decode_tok_per_s": round(steps / decode_s, 2), "tpot_ms": round(decode_s / steps * 1e3, 3),
              "tokens": finished[0].completion_token_ids, "sparse_stats": _stats_summary(llm.get_sparse_stats())}
    if engine is not None:
        h2d_decode = engine.bytes_h2d - h2d_prefill
        result.update(bytes_h2d=engine.bytes_h2d, bytes_d2h=engine.bytes_d2h,
                      decode_h2d_gb_per_s=round(h2d_decode / decode_s / 1e9, 2),
                      kv_bytes_per_token=h2d_decode // steps)
    llm.shutdown()
    del llm
    gc.collect()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model dir (default: random-weight Llama-3.1-8B shape)")
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument("--num-gpu-blocks", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="GPU-only chunk")
    parser.add_argument("--sparse-policy", default="FULL", choices=("FULL", "QUEST", "XATTN_BSA"))
    parser.add_argument("--sparse-threshold", type=float, default=0.9,
                        help="XATTN_BSA: attention mass kept per query block, in [0, 1]")
    parser.add_argument("--sparse-topk-blocks", type=int, default=8, help="QUEST: blocks chosen by score")
    parser.add_argument("--sparse-threshold-blocks", type=int, default=4, help="QUEST: select above this many")
    parser.add_argument("--modes", default="gpu,offload")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    if args.model is None:
        cache = os.environ.get("NANOVLLM_CACHE", os.path.expanduser("~/.cache/nanovllm"))
        args.model = make_random_checkpoint("llama-3.1-8b", os.path.join(cache, "random-llama-3.1-8b"))
    results = {m: run_one(args, m == "offload") for m in args.modes.split(",")}
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "pinned_h2d_gb_per_s": round(pinned_bandwidth("cuda" if torch.cuda.is_available() else "cpu"), 1)}
    for mode, r in results.items():
        report[mode] = {k: v for k, v in r.items() if k != "tokens"}
    if "gpu" in results and "offload" in results:
        report["tokens_identical"] = results["gpu"]["tokens"] == results["offload"]["tokens"]
        report["offload_prefill_ratio"] = round(results["offload"]["prefill_tok_per_s"] / results["gpu"]["prefill_tok_per_s"], 3)
    if "offload" in results and torch.cuda.is_available():
        bound = report["pinned_h2d_gb_per_s"] * 1e9 / results["offload"]["kv_bytes_per_token"]
        report["offload"]["pcie_bound_tok_per_s"] = round(bound, 2)
        report["offload"]["decode_fraction_of_pcie_bound"] = round(results["offload"]["decode_tok_per_s"] / bound, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
