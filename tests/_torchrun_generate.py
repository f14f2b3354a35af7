"""One rank of a torchrun tensor-parallel run (started by the tests, not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/_torchrun_generate.py SPEC.json OUT_DIR

SPEC.json: ``{"model": DIR, "llm": {LLM kwargs}, "prompts": [[ids]], "params": [{SamplingParams
kwargs}], "engines": N (default 1)}``. Every rank builds ``LLM(model,
tensor_parallel_size=WORLD_SIZE, **llm)``, generates and shuts it down, N times one after the
other, and writes each engine's outputs' token ids to ``OUT_DIR/rank<RANK>.json`` (a list of N).
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
    world_size = int(os.environ["WORLD_SIZE"])
    runs = []
    for _ in range(spec.get("engines", 1)):
        with LLM(spec["model"], tensor_parallel_size=world_size, **spec["llm"]) as llm:
            runs.append([o["token_ids"] for o in llm.generate(spec["prompts"], params, use_tqdm=False)])
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
