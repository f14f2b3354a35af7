"""CPU generation throughput of nanovllm against transformers' ``generate``; prints one JSON document.

The workload of issue 16's CPU acceptance, as a new user would run it: SmolLM2-135M-Instruct in
float32, 16 chat prompts, 64 new tokens each, greedy, ``torch.set_num_threads(2)``. Both engines
run in this process on the same token ids: nanovllm's ``LLM.generate`` (all prompts at once) and
transformers' ``generate`` on the left-padded batch. Neither stops at end-of-sequence (nanovllm
``ignore_eos``, transformers without an eos id), so both produce exactly ``max_tokens`` tokens per
prompt, and the tokens are compared: the script exits with status 1 when they differ (the JSON
still names the prompts and first positions that differ). tok/s = generated tokens / wall time
of the whole ``generate`` call (prefill included), the best of ``--repeat`` rounds after a warm-up;
a round runs each engine once, in turn, so both see the same machine load. The 1-minute load
average before and after is reported: on a shared machine it explains noisy numbers.

Usage, from the repository root::

    python -m benchmarks.bench_cpu [--model DIR] [--num-prompts 16] [--max-tokens 64]
        [--threads 2] [--repeat 3]

Without ``--model`` SmolLM2 is fetched once (``python -m nanovllm.fetch``) into ~/.cache/nanovllm.
"""

import argparse
import json
import os
import sys
import time

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "What are the first three prime numbers?",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "How do I boil an egg?",
    "Summarize the plot of Romeo and Juliet.",
    "What does HTTP stand for?",
    "Write a short poem about autumn leaves.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and French.",
    "What is a black hole?",
]


def chat_token_ids(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat-templated prompts (the questions above, cycled) as token-id lists."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def timed_runs(repeat: int, runners: dict) -> dict:
    """Warm each engine up, then time ``repeat`` rounds, each running every engine once in turn
    (so that both see the same machine load); per engine the shortest wall time and the tokens
    of its last run."""
    for run in runners.values():
        run(warmup=True)
    best = {name: (float("inf"), None) for name in runners}
    for _ in range(repeat):
        for name, run in runners.items():
            start = time.perf_counter()
            tokens = run(warmup=False)
            best[name] = (min(best[name][0], time.perf_counter() - start), tokens)
    return best


def nanovllm_runner(model_dir: str, prompts: list[list[int]], max_tokens: int):
    from nanovllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu")

    def run(warmup: bool) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=2 if warmup else max_tokens, ignore_eos=True)
        return [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]

    return llm, run


def transformers_runner(model_dir: str, prompts: list[list[int]], max_tokens: int, pad_id: int):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate() fills an unset eos id from here
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(warmup: bool) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=2 if warmup else max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        return out[:, width:].tolist()

    return run


def first_differences(ours: list[list[int]], theirs: list[list[int]]) -> list[dict]:
    diffs = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": i, "position": pos})
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: fetch SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (each runs both engines once); the best counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from nanovllm.fetch import fetch_model

    model_dir = args.model or fetch_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_token_ids(tokenizer, args.num_prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    llm, run_ours = nanovllm_runner(model_dir, prompts, args.max_tokens)
    run_theirs = transformers_runner(model_dir, prompts, args.max_tokens, pad_id)
    load_before = os.getloadavg()[0]
    best = timed_runs(args.repeat, {"nanovllm": run_ours, "transformers": run_theirs})
    llm.shutdown()
    (ours_s, ours), (theirs_s, theirs) = best["nanovllm"], best["transformers"]

    generated, generated_hf = sum(map(len, ours)), sum(map(len, theirs))
    diffs = first_differences(ours, theirs)
    result = {
        "model": model_dir, "dtype": "float32", "threads": args.threads, "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens, "generated_tokens": generated,
        "nanovllm_s": round(ours_s, 3), "transformers_s": round(theirs_s, 3),
        "nanovllm_tok_s": round(generated / ours_s, 1),
        "transformers_tok_s": round(generated_hf / theirs_s, 1),
        "ratio": round((generated / ours_s) / (generated_hf / theirs_s), 3),
        "identical_tokens": not diffs, "differing_prompts": diffs,
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
