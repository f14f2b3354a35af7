"""Prefix reuse after eviction: long documents asked again after other traffic, with the host tier
as a second-level prefix cache and without it (recomputed); prints JSON.

    python -m benchmarks.prefix_reuse                          # H200: Llama-3.1-8B shape, 24 x 16K, 4 rounds
    python -m benchmarks.prefix_reuse --model DIR --device cpu --dtype float32 --num-docs 4 \\
        --doc-len 512 --gpu-docs 2 --num-rounds 2 --question-len 16 --max-tokens 4   # tiny, on CPU

``--num-docs`` documents of ``--doc-len`` tokens; in each of ``--num-rounds`` rounds every document
is asked a new question (``--question-len`` tokens after it), one request at a time, each
answered with ``--max-tokens`` greedy tokens (96 requests by default). The GPU tier holds about
``--gpu-docs`` requests' KV, so by the time a document comes back the GPU tier has reused its
blocks: mode ``host`` (``enable_cpu_offload=True``, a host tier of ``--host-docs`` requests) finds
them in the host tier (written back when evicted, loaded back at admission), mode ``recompute``
(host tier off) prefills the document again. Reported per mode and round: TTFT (from
``add_request`` to the first token known on the host), prompt tokens found in the prefix cache,
the KV cache statistics; and the TTFT of rounds 2.. of ``recompute`` over ``host``, and whether
both modes gave the same tokens. Default model: a random-weight checkpoint of ``--shape``.
"""
import argparse
import gc
import json
import statistics
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sequence import PLACEHOLDER_TOKEN
from tools.random_checkpoint import SHAPES, cached_random_checkpoint

MODES = ("host", "recompute")


def _sync(device: str):
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 30000), (n,), generator=g).tolist()


def _engine_kwargs(args, mode: str) -> dict:
    request_len = args.doc_len + args.question_len + args.max_tokens
    blocks = -(-request_len // args.block_size)
    kwargs = dict(max_model_len=request_len, kvcache_block_size=args.block_size, max_num_seqs=1,
                  num_kvcache_blocks=args.gpu_docs * blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, device=args.device)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if mode == "host":
        kwargs.update(enable_cpu_offload=True, num_cpu_kvcache_blocks=args.host_docs * blocks)
    return kwargs


def _ask(llm, prompt: list[int], params: SamplingParams, device: str) -> tuple[float, list[int], int]:
    """One request alone: (TTFT in s, its tokens, its prompt tokens found in the prefix cache)."""
    _sync(device)
    t0 = time.perf_counter()
    llm.add_request(prompt, params)
    seq = llm.scheduler.waiting[-1]
    ttft = None
    while not llm.is_finished():
        llm.step()
        if ttft is None and seq.num_completion_tokens and seq.completion_token_ids[0] != PLACEHOLDER_TOKEN:
            ttft = time.perf_counter() - t0
    return ttft, seq.completion_token_ids, seq.num_cached_tokens


def run_mode(args, mode: str, docs: list[list[int]], questions: list[list[list[int]]]) -> dict:
    llm = LLM(args.model, **_engine_kwargs(args, mode))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        _ask(llm, _tokens(args.block_size + 7, 1, 1000), params, args.device)  # warm-up (compiles the kernels)
        rounds, tokens, t0 = [], [], time.perf_counter()
        for r in range(args.num_rounds):
            ttfts, cached = [], []
            for d, doc in enumerate(docs):
                ttft, out, hit = _ask(llm, doc + questions[r][d], params, args.device)
                ttfts.append(ttft)
                cached.append(hit)
                tokens.append(out)
            rounds.append({"round": r + 1, "ttft_mean_s": round(statistics.mean(ttfts), 4),
                           "ttft_median_s": round(statistics.median(ttfts), 4), "ttft_max_s": round(max(ttfts), 4),
                           "cached_tokens_mean": round(statistics.mean(cached), 1)})
        later = [row["ttft_mean_s"] for row in rounds[1:]]
        return {"rounds": rounds, "ttft_mean_s_rounds_2_on": round(statistics.mean(later), 4) if later else None,
                "wall_s": round(time.perf_counter() - t0, 2), "kv_cache": llm.get_kv_cache_stats(),
                "async_scheduling": llm.config.async_scheduling, "tokens": tokens}
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model dir (default: a random-weight checkpoint of --shape)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--num-docs", type=int, default=24)
    parser.add_argument("--doc-len", type=int, default=16384)
    parser.add_argument("--num-rounds", type=int, default=4, help="questions per document, one per round")
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gpu-docs", type=int, default=6, help="requests the GPU tier holds")
    parser.add_argument("--host-docs", type=int, default=None, help="requests the host tier holds (default: all docs + 2)")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes must list some of {', '.join(MODES)}, got {args.modes!r}")
    for name in ("num_docs", "doc_len", "num_rounds", "question_len", "max_tokens", "gpu_docs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.host_docs is None:
        args.host_docs = args.num_docs + 2
    if args.model is None:
        args.model = cached_random_checkpoint(args.shape)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    docs = [_tokens(args.doc_len, 100 + d, vocab) for d in range(args.num_docs)]
    questions = [[_tokens(args.question_len, 10_000 + 100 * r + d, vocab) for d in range(args.num_docs)]
                 for r in range(args.num_rounds)]
    results = {mode: run_mode(args, mode, docs, questions) for mode in modes}
    report = {"device": torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else "cpu",
              "args": {k: v for k, v in vars(args).items() if k != "model"},
              **{mode: {k: v for k, v in r.items() if k != "tokens"} for mode, r in results.items()}}
    if set(MODES) <= set(results):
        host, recompute = results["host"], results["recompute"]
        report["tokens_identical"] = host["tokens"] == recompute["tokens"]
        if host["ttft_mean_s_rounds_2_on"]:
            report["ttft_speedup_rounds_2_on"] = round(recompute["ttft_mean_s_rounds_2_on"]
                                                       / host["ttft_mean_s_rounds_2_on"], 2)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
