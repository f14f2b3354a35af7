"""Compile cost of the sparse policies on a fresh Triton cache (issue 14.5); prints one JSON document.

Each policy (default FULL and XATTN_BSA, GPU-only KV) runs in its own child process with an empty
``TRITON_CACHE_DIR``, so each pays for every kernel it compiles, shared ones included. A child builds
the engine (timed: ``init_s``), then generates 12 prompts of distinct lengths in 1.5-2K tokens one
after another (greedy, ``--max-tokens`` each), twice: the first pass pays the compiles its lengths
trigger (``first_pass_s``, per prompt in ``first_pass_prompt_s``), the second runs compiled
(``second_pass_s``); ``compile_s`` is their difference, ``prefill_density`` the policy's (1.0:
dense), ``compiled_variants`` each Triton kernel's compiled variants (its per-device cache) after
the run. Issue 14's acceptance: XATTN_BSA's first pass <= 2x FULL's (``ratio_first_pass``);
``ratio_with_init`` adds the engine start-up.

The model is SmolLM2-135M-Instruct from ``python -m nanovllm.fetch`` (``~/.cache/nanovllm``) when it
is there, else ``--model DIR``, else a random-weight checkpoint of SmolLM2's shape (compile cost does
not depend on the weights). Prompts are random token ids.

Usage, from the repository root (CUDA)::

    python -m benchmarks.bench_compile [--model DIR] [--max-tokens 16] [--policies FULL XATTN_BSA]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = sorted(random.Random(14).sample(range(1500, 2000), 12))
"""12 distinct prompt lengths in 1.5-2K tokens (fixed seed)."""
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=100000.0, rope_scaling=None)
"""SmolLM2-135M's config fields over the llama-3.1-8b shape of tools.random_checkpoint."""


def _model_dir(requested: str | None) -> tuple[str, str]:
    """(directory, what it is): ``requested``, else fetched SmolLM2, else a random SmolLM2 shape."""
    from nanovllm.fetch import default_dest, is_complete_model_dir
    from tools.random_checkpoint import make_random_checkpoint

    if requested:
        return requested, "given"
    smollm2 = default_dest("smollm2")
    if is_complete_model_dir(smollm2):
        return str(smollm2), "SmolLM2-135M-Instruct"
    path = os.path.join(os.path.dirname(smollm2), "random-smollm2-135m")
    return make_random_checkpoint("llama-3.1-8b", path, **SMOLLM2_SHAPE), "random weights, SmolLM2 shape"


def _compiled_variants() -> dict:
    """``{"module.kernel": compiled variants}`` of every nanovllm.ops Triton kernel compiled on the
    current CUDA device ({} without one)."""
    import torch
    from triton.runtime.jit import JITFunction

    if not torch.cuda.is_available():
        return {}
    device = torch.cuda.current_device()
    found = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("nanovllm.ops."):
            continue
        for attr, fn in vars(module).items():
            if isinstance(fn, JITFunction) and fn.__module__ == name and device in fn.device_caches:
                count = len(fn.device_caches[device][0])
                if count:
                    found[f"{name.rsplit('.', 1)[-1]}.{attr}"] = count
    return found


def _timed_pass(llm, prompts, params) -> list[float]:
    times = []
    for prompt in prompts:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)  # returns token ids: synchronised
        times.append(time.perf_counter() - t0)
    return times


def run_child(args) -> dict:
    """One policy in this process (its Triton cache already set by the parent)."""
    from nanovllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=4096, sparse_policy=args.child, enable_cpu_offload=args.enable_cpu_offload)
    init_s = time.perf_counter() - t0
    first = _timed_pass(llm, prompts, params)
    second = _timed_pass(llm, prompts, params)
    density = llm.get_sparse_stats()["prefill"]["density"]
    variants = _compiled_variants()
    llm.shutdown()
    return dict(init_s=round(init_s, 3), first_pass_s=round(sum(first), 3),
                first_pass_prompt_s=[round(t, 3) for t in first], second_pass_s=round(sum(second), 3),
                compile_s=round(sum(first) - sum(second), 3), prefill_density=density, compiled_variants=variants)


def run_parent(args) -> dict:
    model, kind = _model_dir(args.model)
    result = dict(model=model, model_kind=kind, lengths=LENGTHS, max_tokens=args.max_tokens,
                  enable_cpu_offload=args.enable_cpu_offload, policies={})
    for policy in args.policies:
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            cmd = [sys.executable, "-m", "benchmarks.bench_compile", "--child", policy, "--model", model,
                   "--max-tokens", str(args.max_tokens)] + (["--enable-cpu-offload"] if args.enable_cpu_offload else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"{policy} child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            result["policies"][policy] = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = result["policies"]
    if "FULL" in runs and "XATTN_BSA" in runs:
        full, xattn = runs["FULL"], runs["XATTN_BSA"]
        result["ratio_first_pass"] = round(xattn["first_pass_s"] / full["first_pass_s"], 2)
        result["ratio_with_init"] = round((xattn["init_s"] + xattn["first_pass_s"])
                                          / (full["init_s"] + full["first_pass_s"]), 2)
        result["acceptance_first_pass_le_2x"] = result["ratio_first_pass"] <= 2.0
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model dir (default: fetched SmolLM2, else a random SmolLM2 shape)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    parser.add_argument("--policies", nargs="+", default=["FULL", "XATTN_BSA"])
    parser.add_argument("--enable-cpu-offload", action="store_true", help="KV on the host tier (default GPU-only)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    print(json.dumps(run_child(args) if args.child else run_parent(args)))


if __name__ == "__main__":
    main()
