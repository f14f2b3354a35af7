"""KV blocks a sliding-window model holds over a long decode, with and without releasing the blocks
before the window (``BlockManager.release_window``); prints one JSON document.

A tiny random ``MistralForCausalLM`` (transformers' ``MistralConfig``, 2 layers, GQA 2:1, the window
of ``--window`` tokens) is written to a temporary directory; ``--num-seqs`` prompts of
``--prompt-len`` random tokens decode ``--max-tokens`` tokens each, greedy, on the CPU in float32,
once as the engine runs (releasing) and once with ``release_window`` set to None on the block
manager (every block held until the sequence ends). Before every step the GPU tier's used blocks
(``get_kv_cache_stats()["gpu_blocks_used"]``) are read; the document gives their peak (over all
steps and over decode steps: a prefill chunk holds its blocks until it is computed) and mean,
the released blocks, whether the tokens agree, and the bytes the peaks would be for Mistral-7B's
blocks (32 layers, 8 KV heads of 128, bf16: 32 MiB per 256-token block).

Usage, from the repository root::

    python -m benchmarks.window_release [--window 1024] [--prompt-len 3000] [--max-tokens 3000]
        [--num-seqs 4] [--threads 2] [--max-num-batched-tokens 16384]
"""

import argparse
import json
import tempfile

import torch

MISTRAL_7B_BLOCK_BYTES = 2 * 32 * 256 * 8 * 128 * 2
"""Keys and values of one 256-token block of Mistral-7B in bf16, every layer."""


def write_checkpoint(path: str, window: int, max_positions: int) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    from tools.random_checkpoint import write_word_tokenizer

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                           max_position_embeddings=max_positions, eos_token_id=0, tie_word_embeddings=False)
    MistralForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path


def run(model_dir: str, prompts: list[list[int]], max_tokens: int, max_model_len: int, release: bool,
        max_num_batched_tokens: int) -> dict:
    from nanovllm import LLM, SamplingParams

    blocks = len(prompts) * -(-max_model_len // 256)
    with LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, num_kvcache_blocks=blocks,
             enforce_eager=True, max_num_batched_tokens=max_num_batched_tokens) as llm:
        if not release:
            llm.scheduler.block_manager.release_window = None
        held, step = [], llm.model_runner.run

        def counting(seqs, is_prefill, *args, **kwargs):
            held.append((is_prefill, llm.get_kv_cache_stats()["gpu_blocks_used"]))
            return step(seqs, is_prefill, *args, **kwargs)

        llm.model_runner.run = counting
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_kv_cache_stats()
    used = [n for _, n in held]
    decode = [n for is_prefill, n in held if not is_prefill]
    return {"peak_blocks": max(used), "mean_blocks": round(sum(used) / len(used), 1), "steps": len(held),
            "peak_decode_blocks": max(decode), "released_blocks": stats["released_blocks"],
            "peak_bytes_mistral_7b": max(used) * MISTRAL_7B_BLOCK_BYTES,
            "peak_decode_bytes_mistral_7b": max(decode) * MISTRAL_7B_BLOCK_BYTES,
            "tokens": [o["token_ids"] for o in outputs]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_model_len = args.prompt_len + args.max_tokens
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 2048, (args.num_seqs, args.prompt_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(tmp, args.window, max_model_len)
        runs = {name: run(model_dir, prompts, args.max_tokens, max_model_len, release, args.max_num_batched_tokens)
                for name, release in (("release", True), ("hold", False))}
    same = runs["release"].pop("tokens") == runs["hold"].pop("tokens")
    print(json.dumps({"window": args.window, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                      "num_seqs": args.num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "same_tokens": same, **runs,
                      "peak_saved": round(1 - runs["release"]["peak_blocks"] / runs["hold"]["peak_blocks"], 3),
                      "mean_saved": round(1 - runs["release"]["mean_blocks"] / runs["hold"]["mean_blocks"], 3)},
                     indent=1))


if __name__ == "__main__":
    main()
