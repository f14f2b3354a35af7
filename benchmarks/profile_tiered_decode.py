"""Where a decode step over the host tier spends its time (issue 31): the copy stream, the kernels
and the host. Prints one JSON document.

The engine and workload are ``bench_offload.py``'s, in its ``--mode`` (``tiered`` by default). After every
prefill and two decode steps, ``--steps`` decode steps are timed (wall, synchronised), profiled with
the torch profiler (GPU time of host-to-device copies, their count and bytes, and of kernels by
name, per step) and run under cProfile (the functions of most own host time, ms per step). A step
whose copies take about its wall time is bound by the link; one whose copies take much less is
waiting on the host (launches) or on the fold.

    python -m benchmarks.profile_tiered_decode --shape qwen2.5-0.5b --input-len 8192 --num-seqs 32 \\
        --block-size 256 --num-kvcache-blocks 264 --decode-tokens 40
"""
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_offload import MODES, build_parser, engine_kwargs, parse_args, random_prompts, step_until_decoding, sync
from benchmarks.hardware import bandwidths
from benchmarks.profile_decode import host_profile, per_unit, run_steps
from nanovllm import LLM, SamplingParams


def gpu_profile(llm, steps: int) -> dict:
    """GPU milliseconds per step: host-to-device copies (time, count, MB) and kernels by name."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(llm, steps)
    copies = collections.Counter()
    kernels = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time_total / 1e3 / steps
        if "HtoD" in event.name:
            copies["ms"] += ms
            copies["count"] += 1 / steps
        else:
            kernels[event.name[:80]] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"h2d_copy_ms_per_step": round(copies["ms"], 3), "h2d_copies_per_step": round(copies["count"], 1),
            "kernel_ms_per_step": round(sum(kernels.values()), 3),
            "top_kernels_ms_per_step": {k: round(v, 4) for k, v in top}}


def main() -> None:
    parser = build_parser()
    parser.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    parser.add_argument("--cprofile", type=int, default=25, metavar="N", help="host functions listed")
    parser.add_argument("--mode", default="tiered", choices=MODES,
                        help="bench_offload's mode (gpu: no host tier)")
    args = parse_args(parser)
    if args.decode_tokens < 3 * args.steps + 3:
        parser.error(f"--decode-tokens must be at least 3 x --steps + 3 = {3 * args.steps + 3}, "
                     f"got {args.decode_tokens}")
    llm = LLM(args.model, **engine_kwargs(args, args.mode))
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for prompt in random_prompts(args, llm.config.hf_config.vocab_size):
        llm.add_request(prompt, params)
    step_until_decoding(llm)
    run_steps(llm, 2)
    host = llm.model_runner.cache.host
    loaded_bytes = host.loaded_bytes if host is not None else lambda: 0
    loaded = loaded_bytes()
    t = time.perf_counter()
    run_steps(llm, args.steps)
    wall_ms = (time.perf_counter() - t) * 1e3 / args.steps
    host_bytes = (loaded_bytes() - loaded) / args.steps
    bw = bandwidths()
    report = {"device": torch.cuda.get_device_name(), **bw,
              "args": {k: v for k, v in vars(args).items() if k != "model"},
              "wall_ms_per_step": round(wall_ms, 3), "host_mb_per_step": round(host_bytes / 1e6, 1),
              "link_bound_ms_per_step": round(host_bytes / (bw["pinned_h2d_gb_per_s"] * 1e9) * 1e3, 3),
              "kv_cache_stats": llm.get_kv_cache_stats(), **gpu_profile(llm, args.steps)}
    if args.cprofile:
        report["host_ms_per_step"] = per_unit(host_profile(lambda: run_steps(llm, args.steps), args.cprofile),
                                              args.steps)
    sync()
    llm.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
