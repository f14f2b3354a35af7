"""Teacher-forced top-1 agreement of an fp8 KV cache with float32 KV on real text. Prints JSON.

    python -m benchmarks.kv_dtype_agreement --model DIR [--tokens 2048] [--chunk 512]

The text (docs/*.md by default, concatenated) is cut to ``--tokens`` tokens and prefilled in
chunks of ``--chunk`` (later chunks read the earlier ones from the cache, as a decode would); at
every position the engine's top-1 next token with each ``--kv-cache-dtypes`` cache is compared
with the same engine's over float32 KV (float32 compute throughout). One JSON line per dtype:
``agree`` of ``positions`` and their ratio ``agreement``.
"""
import argparse
import glob
import json
from pathlib import Path

from nanovllm import LLM, SamplingParams


def teacher_forced_top1(llm: LLM, prompt_ids: list[int]) -> list[int]:
    """The top-1 next token at every prompt position after the first (``prompt_logprobs``)."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    return [next(t for t, lp in entry.items() if lp.rank == 1) for entry in out.prompt_logprobs[1:]]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--text", nargs="+", default=sorted(glob.glob("docs/*.md")), help="text files, concatenated")
    parser.add_argument("--tokens", type=int, default=2048, help="positions of text (default 2048)")
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (default 512)")
    parser.add_argument("--kv-cache-dtypes", default="fp8_e4m3,fp8_e5m2", help="comma-separated (default both fp8)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    text = "".join(Path(path).read_text() for path in args.text)
    opts = dict(dtype="float32", device=args.device, max_model_len=args.tokens + 16, enforce_eager=True,
                max_num_batched_tokens=args.chunk)
    with LLM(args.model, **opts) as llm:
        ids = llm.get_tokenizer()(text)["input_ids"][:args.tokens]
        if len(ids) < args.tokens:
            raise ValueError(f"--text holds {len(ids)} tokens, fewer than --tokens={args.tokens}")
        reference = teacher_forced_top1(llm, ids)
    for dtype in args.kv_cache_dtypes.split(","):
        with LLM(args.model, kv_cache_dtype=dtype, **opts) as llm:
            top1 = teacher_forced_top1(llm, ids)
        agree = sum(a == b for a, b in zip(reference, top1))
        print(json.dumps({"model": args.model, "kv_cache_dtype": dtype, "positions": len(reference), "agree": agree,
                          "agreement": round(agree / len(reference), 4), "chunk": args.chunk}), flush=True)


if __name__ == "__main__":
    main()
