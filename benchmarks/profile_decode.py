"""Where a decode step of bench.py's workload spends its time (issue 16): host phases and GPU
kernels by category. Prints one JSON document.

The engine of ``bench.py`` (random Qwen3-0.6B shape, 256 sequences) gets every request, steps
until every prefill is done, then times ``--steps`` decode steps, each host phase measured with
``time.perf_counter`` around the engine's methods (schedule, input preparation, graph launch,
sampler launch, the wait for the step's tokens, postprocess), and profiles 10 more with the torch
profiler (CUDA kernels, also those inside CUDA graphs), summed by category. With ``--cprofile N``
a further ``--steps`` steps run under cProfile and the N functions of most own host time are
listed (ms per step): where a step is host-bound (wall above GPU time), what to make cheaper.

    python -m benchmarks.profile_decode --mode sync     # or async, eager
    python -m benchmarks.profile_decode --num-seqs 16 --cprofile 30    # a small batch's host time
"""
import argparse
import collections
import cProfile
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench import workload
from nanovllm import LLM, SamplingParams
from nanovllm.engine import sampling_batch
from tools.random_checkpoint import cached_random_checkpoint

CATEGORIES = (("decode_attention", ("decode",)), ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "cublas")),
              ("sampling", ("race", "softmax", "argmax", "distribution", "gather")),
              ("rmsnorm", ("rms",)), ("rope", ("rotary",)), ("kv_store", ("store_kv",)),
              ("silu_and_mul", ("silu",)), ("copies", ("memcpy", "memset")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def timed_phases(llm, totals: dict) -> None:
    """Wrap the engine's step phases so that each adds its host seconds to ``totals``."""
    def wrap(name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t
        return timed

    runner, scheduler = llm.model_runner, llm.scheduler
    scheduler.schedule = wrap("schedule", scheduler.schedule)
    scheduler.postprocess = wrap("postprocess", scheduler.postprocess)
    runner.cache.prepare = wrap("prepare_inputs", runner.cache.prepare)
    runner.run_model = wrap("launch_model", runner.run_model)
    runner.step_sampler = wrap("launch_sampler", runner.step_sampler)
    sampling_batch.SampledStep.output = wrap("wait_for_tokens", sampling_batch.SampledStep.output)


def kernel_ms(llm, steps: int) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    by_cat, by_name = collections.defaultdict(float), collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_cat[category(event.name)] += event.device_time_total / 1e3 / steps
            by_name[event.name[:80]] += event.device_time_total / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    return {"gpu_ms_per_step": round(sum(by_cat.values()), 3),
            "gpu_ms_by_category": {k: round(v, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k: round(v, 4) for k, v in top}}


def host_profile(run, top: int) -> dict:
    """``run()`` under cProfile: the ``top`` functions by own time, ``{"file:line(name)": [own ms,
    cumulative ms]}`` over the whole call."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {f"{file.rsplit('/', 2)[-1]}:{line}({name})": [own * 1e3, cum * 1e3]
            for (file, line, name), (_, _, own, cum, _) in rows}


def per_unit(totals: dict, units: int) -> dict:
    """:func:`host_profile`'s milliseconds per step (or chunk), rounded."""
    return {k: [round(ms / units, 4) for ms in v] for k, v in totals.items()}


def run_steps(llm, steps: int) -> None:
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("sync", "async", "eager"), default="async")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--num-seqs", type=int, default=256, help="bench.py's requests (the decode batch)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also list the N functions of most own host time per step")
    args = parser.parse_args()
    model = cached_random_checkpoint("qwen3-0.6b")
    llm = LLM(model, max_model_len=4096, enforce_eager=args.mode == "eager", async_scheduling=args.mode == "async")
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    for prompt, params in zip(*workload(args.num_seqs, 1024, 1024)):
        llm.add_request(prompt, params)
    while llm.step()[1] >= 0:  # prefill steps, up to the first decode step
        pass
    for _ in range(10):
        llm.step()
    torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    timed_phases(llm, totals)
    start = time.perf_counter()
    run_steps(llm, args.steps)
    wall = time.perf_counter() - start
    result = {"mode": args.mode, "batch": len(llm.scheduler.running), "steps": args.steps,
              "wall_ms_per_step": round(wall / args.steps * 1e3, 3),
              "host_ms_per_step": {k: round(v / args.steps * 1e3, 3) for k, v in totals.items()},
              **kernel_ms(llm, 10)}
    if args.cprofile:
        result["host_top_functions_ms_per_step"] = per_unit(
            host_profile(lambda: run_steps(llm, args.steps), args.cprofile), args.steps)
    llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
