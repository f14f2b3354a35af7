"""Where bench.py's prefill chunks spend their time (issue 16): host phases and CUDA kernels.

The engine of ``bench.py`` (random Qwen3-0.6B shape) first runs a warm-up batch of 256 random
prompts (2 tokens each, so every prefill shape is compiled). Then bench.py's 256 requests are
added and the engine steps through their prefill chunks twice over fresh prompts (no prefix-cache
hits): once with host phases timed around the engine's methods (as ``profile_decode``) and
``torch.cuda.set_sync_debug_mode("warn")`` counting synchronizing CUDA calls by call site, once
under the torch profiler (CUDA kernels summed by category, FlashAttention apart from the GEMMs).
Prints one JSON document. ``--cprofile N`` runs the first pass under cProfile too and lists the
N functions of most own host time per chunk.

    python -m benchmarks.profile_bench_prefill      # CUDA only
    python -m benchmarks.profile_bench_prefill --cprofile 30
"""
import argparse
import collections
import json
import random
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from bench import workload
from benchmarks.profile_decode import category, host_profile, per_unit, timed_phases
from nanovllm import LLM, SamplingParams
from tools.random_checkpoint import cached_random_checkpoint


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]


def prefill_steps(llm, prompts, params) -> list[float]:
    """Add the requests and step through their prefill; the wall ms of each step."""
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    walls = []
    while True:
        start = time.perf_counter()
        _, num_tokens = llm.step()
        torch.cuda.synchronize()
        if num_tokens < 0:  # the first decode step
            return walls
        walls.append(round((time.perf_counter() - start) * 1e3, 2))


def count_syncs(counter: collections.Counter):
    """Count each synchronizing CUDA call by its innermost nanovllm frames."""
    def show(message, *args, **kwargs):
        frames = [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                  for f in traceback.extract_stack()[:-1] if "nanovllm" in f.filename]
        counter[" <- ".join(reversed(frames[-3:]))] += 1
    warnings.showwarning = show
    warnings.simplefilter("always")


def warm_engine() -> LLM:
    """bench.py's engine after a warm-up batch that compiled every prefill shape."""
    llm = LLM(cached_random_checkpoint("qwen3-0.6b"), max_model_len=4096)
    llm.generate(random_prompts(1), SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="list the N functions of most own host time per chunk (first pass)")
    args = parser.parse_args()
    llm = warm_engine()
    prompts, params = workload(256, 1024, 1024)
    host, syncs = collections.defaultdict(float), collections.Counter()
    timed_phases(llm, host)
    count_syncs(syncs)
    torch.cuda.set_sync_debug_mode("warn")
    if args.cprofile:
        walls = []
        top = host_profile(lambda: walls.extend(prefill_steps(llm, prompts, params)), args.cprofile)
    else:
        walls = prefill_steps(llm, prompts, params)
    torch.cuda.set_sync_debug_mode(0)
    result = {"chunks": len(walls), "wall_ms": walls,
              "host_ms_per_chunk": {k: round(v * 1e3 / len(walls), 2) for k, v in host.items()},
              "synchronizing_calls": dict(syncs.most_common(10))}
    if args.cprofile:
        result["host_top_functions_ms_per_chunk"] = per_unit(top, len(walls))
    llm.shutdown()
    llm = warm_engine()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        walls = prefill_steps(llm, random_prompts(2), params)
    by_category = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = "prefill_attention" if "flash" in event.name.lower() else category(event.name)
            by_category[name] += event.device_time_total / 1e3 / len(walls)
    result["kernel_ms_per_chunk"] = round(sum(by_category.values()), 2)
    result["kernel_ms_per_chunk_by_category"] = {k: round(v, 2) for k, v in
                                                 sorted(by_category.items(), key=lambda kv: -kv[1])}
    llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
