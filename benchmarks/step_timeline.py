"""Where bench.py's time goes, step by step (issue 16): GPU time of every engine step against the
step's own roofline, summed over prefill steps and over decode steps binned by batch size. Prints
one JSON document.

The engine and workload are bench.py's (random Qwen3-0.6B shape, 256 sequences). A CUDA event is
recorded on the current stream as each step is launched (``ModelRunner.run``) and one after the
last, so a step's time is the GPU time from its launch to the next one's, idle gaps included. A
decode step of ``B`` sequences holding ``T`` tokens of KV must read at least the weights and
``T`` tokens of KV, at the HBM bandwidth measured by ``benchmarks.hardware``; that is its roofline.

    python -m benchmarks.step_timeline            # async scheduling (bench.py's default)
    python -m benchmarks.step_timeline --no-async-scheduling
"""
import argparse
import collections
import json

import torch

from bench import checkpoint_bytes, workload
from benchmarks.hardware import bandwidths
from nanovllm import LLM, SamplingParams
from tools.random_checkpoint import cached_random_checkpoint

BATCH_BINS = (1, 16, 64, 128, 192, 257)


def record_steps(llm) -> list[tuple[torch.cuda.Event, int, bool, int]]:
    """Wrap ``ModelRunner.run`` so that each step appends ``(event, batch, is_prefill, tokens)``:
    ``tokens`` is the KV the step reads (decode) or the tokens it computes (prefill)."""
    steps, run = [], llm.model_runner.run

    def recorded(seqs, is_prefill, *args, **kwargs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else sum(len(s) for s in seqs)
        steps.append((event, len(seqs), is_prefill, tokens))
        return run(seqs, is_prefill, *args, **kwargs)

    llm.model_runner.run = recorded
    return steps


def summarize(steps, end: torch.cuda.Event, weight_bytes: int, kv_bytes: int, hbm: float) -> dict:
    bins = collections.defaultdict(lambda: {"steps": 0, "seconds": 0.0, "roofline_seconds": 0.0})
    for (event, batch, is_prefill, tokens), (following, *_) in zip(steps, steps[1:] + [(end,)]):
        seconds = event.elapsed_time(following) / 1e3
        if is_prefill:
            key = "prefill"
            bound = 0.0
        else:
            low = max(b for b in BATCH_BINS if b <= batch)
            key = f"decode_batch_{low}-{BATCH_BINS[BATCH_BINS.index(low) + 1] - 1}"
            bound = (weight_bytes + tokens * kv_bytes) / (hbm * 1e9)
        row = bins[key]
        row["steps"] += 1
        row["seconds"] += seconds
        row["roofline_seconds"] += bound
    for row in bins.values():
        bound = row["roofline_seconds"]
        row["fraction_of_roofline"] = round(bound / row["seconds"], 3) if bound else None
        row["ms_per_step"] = round(row["seconds"] / row["steps"] * 1e3, 3)
        row["seconds"], row["roofline_seconds"] = round(row["seconds"], 3), round(row["roofline_seconds"], 3)
    return dict(sorted(bins.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    model = cached_random_checkpoint("qwen3-0.6b")
    llm = LLM(model, max_model_len=4096, async_scheduling=args.async_scheduling)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    prompts, params = workload(256, 1024, 1024)
    steps = record_steps(llm)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    llm.generate(prompts, params, use_tqdm=False)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    hbm = bandwidths()["hbm_gb_per_s"]
    bins = summarize(steps, end, *checkpoint_bytes(model), hbm)
    total = start.elapsed_time(end) / 1e3
    print(json.dumps({"gpu_seconds": round(total, 3), "before_first_step_seconds":
                      round(start.elapsed_time(steps[0][0]) / 1e3, 3), "hbm_gb_per_s": hbm,
                      "steps": len(steps), "bins": bins}, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
