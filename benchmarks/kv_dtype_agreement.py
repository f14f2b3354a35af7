"""Teacher-forced top-1 agreement of an fp8 KV cache with float32 KV on real text. Prints JSON.

    python -m benchmarks.kv_dtype_agreement --model DIR [--tokens 2048] [--chunk 512]

The text (docs/*.md by default, concatenated) is cut to ``--tokens`` tokens and prefilled in
chunks of ``--chunk`` (later chunks read the earlier ones from the cache, as a decode would); at
every position the engine's top-1 next token with each ``--kv-cache-dtypes`` cache is compared
with the same engine's over float32 KV (float32 compute throughout). One JSON line per dtype:
``agree`` of ``positions`` and their ratio ``agreement``.

``--other-chunk N`` also compares each cache dtype, float32 KV (``auto``) included, with itself
prefilled in chunks of N: the top-1 agreement and the largest and mean gap between the two runs'
logprobs of the text's tokens (fp8 rounding turns float32's summation-order differences into
steps of one fp8 unit: docs/kvcache.md, "What an fp8 cache's outputs depend on"). One more JSON
line per dtype, with ``"chunks": [chunk, N]``.
"""
import argparse
import glob
import json
from pathlib import Path

from nanovllm import LLM, SamplingParams


def teacher_forced(llm: LLM, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """At every prompt position after the first (``prompt_logprobs``): the top-1 next token, and
    the logprob of the text's own token."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    entries = out.prompt_logprobs[1:]
    top1 = [next(t for t, lp in entry.items() if lp.rank == 1) for entry in entries]
    return top1, [entry[token].logprob for entry, token in zip(entries, prompt_ids[1:])]


def _agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    agree = sum(x == y for x, y in zip(a, b))
    return agree, round(agree / len(a), 4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--text", nargs="+", default=sorted(glob.glob("docs/*.md")), help="text files, concatenated")
    parser.add_argument("--tokens", type=int, default=2048, help="positions of text (default 2048)")
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (default 512)")
    parser.add_argument("--kv-cache-dtypes", default="fp8_e4m3,fp8_e5m2", help="comma-separated (default both fp8)")
    parser.add_argument("--other-chunk", type=int, help="also compare each dtype with itself at this chunk")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    text = "".join(Path(path).read_text() for path in args.text)
    opts = dict(dtype="float32", device=args.device, max_model_len=args.tokens + 16, enforce_eager=True,
                max_num_batched_tokens=args.chunk)
    with LLM(args.model, **opts) as llm:
        ids = llm.get_tokenizer()(text)["input_ids"][:args.tokens]
        if len(ids) < args.tokens:
            raise ValueError(f"--text holds {len(ids)} tokens, fewer than --tokens={args.tokens}")
        runs = {"auto": teacher_forced(llm, ids)}
        reference = runs["auto"][0]
    for dtype in args.kv_cache_dtypes.split(","):
        with LLM(args.model, kv_cache_dtype=dtype, **opts) as llm:
            runs[dtype] = teacher_forced(llm, ids)
        agree, ratio = _agreement(reference, runs[dtype][0])
        print(json.dumps({"model": args.model, "kv_cache_dtype": dtype, "positions": len(reference), "agree": agree,
                          "agreement": ratio, "chunk": args.chunk}), flush=True)
    if args.other_chunk is None:
        return
    for dtype, (top1, logprobs) in runs.items():
        with LLM(args.model, kv_cache_dtype=dtype, **{**opts, "max_num_batched_tokens": args.other_chunk}) as llm:
            other_top1, other_logprobs = teacher_forced(llm, ids)
        agree, ratio = _agreement(top1, other_top1)
        gaps = [abs(a - b) for a, b in zip(logprobs, other_logprobs)]
        print(json.dumps({"model": args.model, "kv_cache_dtype": dtype, "chunks": [args.chunk, args.other_chunk],
                          "positions": len(gaps), "agree": agree, "agreement": ratio,
                          "max_logprob_gap": max(gaps), "mean_logprob_gap": sum(gaps) / len(gaps)}), flush=True)


if __name__ == "__main__":
    main()
