"""One rank of a torchrun tensor-parallel run (started by the tests, not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/_torchrun_generate.py SPEC.json OUT_DIR

SPEC.json: ``{"model": DIR, "llm": {LLM kwargs}, "prompts": [[ids]], "params": [{SamplingParams
kwargs}], "engines": N (default 1), "rank_prompts": {rank: [[ids]]} (optional, replaces
"prompts" on that rank)}``. Every rank builds ``LLM(model, tensor_parallel_size=WORLD_SIZE / D,
**llm)`` (D: ``llm``'s ``data_parallel_size``, default 1), generates and shuts it down, N times one
after the other, and writes each engine's outputs' token ids to ``OUT_DIR/rank<RANK>.json`` (a list
of N), or ``{"error": message}`` if generate raised a RuntimeError; per engine and request, the
sampled tokens' logprobs and the prompt tokens' logprobs (None where not asked for) to
``OUT_DIR/rank<RANK>_logprobs.json``; and each engine's ``get_kv_cache_stats()`` after its generate
and its request ids to ``OUT_DIR/rank<RANK>_stats.json``.
"""
import json
import os
import sys

from nanovllm import LLM, SamplingParams


def main():
    spec_path, out_dir = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    params = [SamplingParams(**p) for p in spec["params"]]
    world_size, rank = int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
    tp_size = world_size // spec["llm"].get("data_parallel_size", 1)
    prompts = spec.get("rank_prompts", {}).get(rank, spec["prompts"])
    result, logprobs, stats = [], [], []
    try:
        for _ in range(spec.get("engines", 1)):
            with LLM(spec["model"], tensor_parallel_size=tp_size, **spec["llm"]) as llm:
                outs = llm.generate(prompts, params, use_tqdm=False)
                result.append([o["token_ids"] for o in outs])
                logprobs.append([_logprobs(o) for o in outs])
                stats.append({"kv_cache": llm.get_kv_cache_stats(), "request_ids": [o.request_id for o in outs]})
    except RuntimeError as err:
        result = {"error": str(err)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    with open(os.path.join(out_dir, f"rank{rank}_logprobs.json"), "w") as f:
        json.dump(logprobs, f)
    with open(os.path.join(out_dir, f"rank{rank}_stats.json"), "w") as f:
        json.dump(stats, f)


def _logprobs(out) -> dict:
    """The logprob of each sampled token and of each prompt token after the first (or None)."""
    c = out.outputs[0]
    return {"sampled": None if c.logprobs is None else [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
            "prompt": None if out.prompt_logprobs is None else [
                d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]}


if __name__ == "__main__":
    main()
