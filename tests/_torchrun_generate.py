"""One rank of a torchrun tensor-parallel run (started by the tests, not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/_torchrun_generate.py SPEC.json OUT_DIR

SPEC.json: ``{"model": DIR, "llm": {LLM kwargs}, "prompts": [[ids]], "params": [{SamplingParams
kwargs}], "engines": N (default 1), "rank_prompts": {rank: [[ids]]} (optional, replaces
"prompts" on that rank)}``. Every rank builds ``LLM(model, tensor_parallel_size=WORLD_SIZE,
**llm)``, generates and shuts it down, N times one after the other, and writes each engine's
outputs' token ids to ``OUT_DIR/rank<RANK>.json`` (a list of N), or ``{"error": message}`` if
generate raised a RuntimeError.
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
    prompts = spec.get("rank_prompts", {}).get(rank, spec["prompts"])
    result = []
    try:
        for _ in range(spec.get("engines", 1)):
            with LLM(spec["model"], tensor_parallel_size=world_size, **spec["llm"]) as llm:
                result.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
    except RuntimeError as err:
        result = {"error": str(err)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
