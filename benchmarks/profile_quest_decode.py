"""Where a QUEST decode step over the host tier spends its time (issue 14): the forward's host
launch time against the step, and the GPU kernels. Prints one JSON document.

A random Llama-3.1-8B shape with ``--layers`` of its 32 layers (the per-layer chain is the same,
the run shorter) gets one ``--input-len``-token prompt; its KV lives on the host tier but for the 2
GPU-tier blocks (4,096-token blocks, 4 ring slots). Per layer and KV head, QUEST picks
``--token-budget`` tokens of pages of ``--page-size`` tokens (``--group-score``), besides the
``--sink-tokens`` and ``--recent-tokens`` every step reads; the first ``--dense-layers`` layers read
everything through the ring. After the prefill and 4 warm-up decode steps, ``--steps`` steps are
timed (the step with a device synchronize, and the host time of ``ModelRunner.run_model``, i.e. of
launching the forward), then 3 more are profiled with the torch profiler (kernels per step, GPU busy
time per step); the trace goes to ``--trace`` when given. The JSON also holds the KV cache's and
the decode's sparse statistics (density, host bytes loaded, reuse rate).

    python -m benchmarks.profile_quest_decode --layers 8 --reuse-rows 0 --trace quest.json
    python -m benchmarks.profile_quest_decode --page-size 64 --token-budget 4096 --group-score sum
"""
import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.engine import model_runner
from nanovllm.sparse import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET
from tools.random_checkpoint import cached_random_checkpoint


def _busy_ms(events) -> float:
    """Union of the GPU intervals (kernels and copies) of ``events``, in ms."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    busy, current = 0, None
    for start, end in intervals:
        if current is None or start > current[1]:
            busy += current[1] - current[0] if current else 0
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return (busy + (current[1] - current[0] if current else 0)) / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reuse-rows", type=int, default=0,
                   help="num_reuse_cache_blocks (0: no reuse cache, -1: the engine's default)")
    p.add_argument("--input-len", type=int, default=130000)
    p.add_argument("--page-size", type=int, default=16, choices=(16, 32, 64), help="sparse_page_size (default 16)")
    p.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET,
                   help=f"sparse_token_budget (default {DEFAULT_TOKEN_BUDGET})")
    p.add_argument("--sink-tokens", type=int, default=16, help="sparse_sink_tokens (default 16)")
    p.add_argument("--recent-tokens", type=int, default=256, help="sparse_recent_tokens (default 256)")
    p.add_argument("--dense-layers", type=int, default=0, help="sparse_dense_layers (default 0)")
    p.add_argument("--group-score", default=DEFAULT_GROUP_SCORE, choices=("max", "sum"),
                   help=f"sparse_group_score (default {DEFAULT_GROUP_SCORE})")
    p.add_argument("--radius-weight", type=float, default=DEFAULT_RADIUS_WEIGHT,
                   help=f"sparse_radius_weight (default {DEFAULT_RADIUS_WEIGHT})")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trace", help="write the profiler's Chrome trace here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA (it profiles GPU kernels)")
    model = cached_random_checkpoint("llama-3.1-8b", num_hidden_layers=args.layers)
    llm = LLM(model, max_model_len=args.input_len + 100, kvcache_block_size=4096, enable_cpu_offload=True,
              num_kvcache_blocks=2, num_ring_slots=4, sparse_policy="QUEST", sparse_page_size=args.page_size,
              sparse_token_budget=args.token_budget, sparse_sink_tokens=args.sink_tokens,
              sparse_recent_tokens=args.recent_tokens, sparse_dense_layers=args.dense_layers,
              sparse_group_score=args.group_score, sparse_radius_weight=args.radius_weight,
              num_reuse_cache_blocks=args.reuse_rows)
    launches = []
    run_model = model_runner.ModelRunner.run_model

    def timed_run_model(self, *a, **k):
        start = time.perf_counter()
        result = run_model(self, *a, **k)
        launches.append(time.perf_counter() - start)
        return result

    model_runner.ModelRunner.run_model = timed_run_model
    prompt = torch.randint(1, 30000, (args.input_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.add_request(prompt, SamplingParams(max_tokens=args.steps + 10, ignore_eos=True))
    while llm.step()[1] >= 0:  # prefill chunks, until the first decode step
        pass
    for _ in range(4):
        llm.step()
    torch.cuda.synchronize()
    llm.reset_sparse_stats()  # the statistics of the timed and profiled steps
    steps = []
    for _ in range(args.steps):
        launches.clear()
        start = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        steps.append({"step_ms": round((time.perf_counter() - start) * 1e3, 2),
                      "forward_launch_ms": round(sum(launches) * 1e3, 2)})
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels = sorted(((e.key, e.device_time_total / 3, e.count / 3) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda x: -x[1])[:30]
    decode = {k: v for k, v in llm.get_sparse_stats()["decode"].items() if k != "per_layer"}
    print(json.dumps({"layers": args.layers, "reuse_rows": args.reuse_rows, "page_size": args.page_size,
                      "token_budget": args.token_budget, "sink_tokens": args.sink_tokens,
                      "recent_tokens": args.recent_tokens, "dense_layers": args.dense_layers,
                      "group_score": args.group_score, "steps": steps,
                      "gpu_busy_ms_per_step": round(_busy_ms(prof.events()) / 3, 2),
                      "kernels_us_per_step": [(k, round(t), c) for k, t, c in kernels],
                      "kv": llm.get_kv_cache_stats(), "decode_sparse_stats": decode}, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
