"""Where TP=2 and TP=1 greedy tokens part in bfloat16, and how close the tie was. Prints JSON.

    python benchmarks/tp_agreement.py --shape llama-3.1-8b     # needs 2 GPUs

Both engines run the same 8 random prompts (64..1024 tokens) for 64 greedy tokens with CUDA
graphs. For each prompt whose tokens differ, the report gives the first differing step and,
from TP=1's float32 logits at that step (teacher-forced on TP=1's own tokens), the gap between
TP=1's token and TP=2's token: a gap of a few bfloat16 steps means the two runs parted at a
near-tie, which summation order alone decides (see tests/gpu/test_tp_gpu.py).
"""
import argparse
import json

import torch

from nanovllm import LLM, SamplingParams
from tools.divergence import first_difference, parting
from tools.random_checkpoint import cached_random_checkpoint


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 1025, (n,), generator=g).tolist()
    return [torch.randint(1, 32000, (length,), generator=g).tolist() for length in lengths]


def generate(model: str, batch, params, tp: int, **opts) -> list[list[int]]:
    with LLM(model, tensor_parallel_size=tp, **opts) as llm:
        return [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]


def report_parting(llm, prompt, ours, theirs) -> dict | None:
    """First step where TP=2's tokens differ from TP=1's and the logit gap there (TP=1's logits)."""
    p = parting(llm, prompt, ours, theirs)
    if p is None:
        return None
    return {"step": p["step"], "logit_gap": round(p["logit_gap"], 5), "tp2_token_rank_in_tp1": p["theirs_rank"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = cached_random_checkpoint(args.shape)
    batch = prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    opts = dict(max_model_len=2048, max_num_seqs=64, dtype=args.dtype)
    tp2 = generate(model, batch, params, 2, **opts)
    with LLM(model, **opts) as llm:
        tp1 = [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
        partings = [report_parting(llm, p, a, b) for p, a, b in zip(batch, tp1, tp2)]
    firsts = [first_difference(x, y) for x, y in zip(tp1, tp2)]
    same = sum(len(x) if step is None else step for x, step in zip(tp1, firsts))
    print(json.dumps({"shape": args.shape, "dtype": args.dtype, "prompts": len(batch),
                      "max_tokens": args.max_tokens, "identical_prompts": sum(p is None for p in partings),
                      "tokens_before_first_difference": same, "tokens": len(batch) * args.max_tokens,
                      "partings": partings}))


if __name__ == "__main__":
    main()
