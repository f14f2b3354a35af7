r"""How long ``LLM(...)`` takes to build with the host tier on and off; prints JSON lines.

    python -m benchmarks.bench_startup --shapes smollm2-135m,qwen2.5-0.5b,llama-3.1-8b

For each shape (a random-weight checkpoint of ``tools.random_checkpoint.SHAPES``, made once in a
child process), three fresh processes build the engine, GPU-only, with ``enable_cpu_offload=True``,
then GPU-only again (the first process pays the kernels' first compiles), each with
``max_model_len`` 32,768 (or the model's context if shorter) and default budgets, then greedily
decode 8 tokens of a 1,999-token prompt. A line: ``build_s`` (the ``LLM(...)`` call),
``host_bytes_pinned`` at build and after the request, and the tokens (the same in every mode).
"""
import argparse
import json
import os
import subprocess
import sys
import time


def build_once(path: str, mode: str) -> dict:
    from nanovllm import LLM, SamplingParams

    with open(os.path.join(path, "config.json")) as f:
        max_model_len = min(32768, json.load(f)["max_position_embeddings"])
    t = time.perf_counter()
    llm = LLM(path, enable_cpu_offload=(mode == "tiered"), max_model_len=max_model_len)
    build_s = time.perf_counter() - t
    at_build = llm.get_kv_cache_stats()["host_bytes_pinned"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([list(range(1, 2000))], params, use_tqdm=False)[0]["token_ids"]
    after = llm.get_kv_cache_stats()["host_bytes_pinned"]
    llm.shutdown()
    return {"mode": mode, "build_s": round(build_s, 2), "host_bytes_pinned_at_build": at_build,
            "host_bytes_pinned_after": after, "tokens": tokens}


def _child(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_startup", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"bench_startup {' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return p.stdout.splitlines()[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,llama-3.1-8b", help="comma-separated SHAPES keys")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--make", metavar="SHAPE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make:
        from tools.random_checkpoint import cached_random_checkpoint
        print(cached_random_checkpoint(args.make))
        return
    if args.child:
        print(json.dumps(build_once(*args.child)))
        return
    for shape in args.shapes.split(","):
        path = _child("--make", shape)  # in a child: the weights' GPU memory is freed with it
        for mode in ("gpu", "tiered", "gpu"):
            print(json.dumps({"shape": shape, **json.loads(_child("--child", path, mode))}), flush=True)


if __name__ == "__main__":
    main()
