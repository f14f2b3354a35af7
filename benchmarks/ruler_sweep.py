"""RULER over sequence lengths and engine settings: one JSON line per (setting, length).

For every setting (--settings) at every length (--lengths: RULER's sequence length, prompt plus
answer; prompts have LENGTH - 128 tokens), the evaluation of tests/test_ruler.py runs: one greedy
generate per task with all of its samples batched, scored with RULER's metric. Each (setting,
length) appends one JSON line to --out: every task's mean score, the average over tasks, the
sparse densities (LLM.get_sparse_stats) and the generate time. A setting that fails is recorded
with its error and the sweep goes on; --table prints the lines as a Markdown table.

Settings: full-gpu (FULL, no host tier); full-host-2 / full-host-4 (FULL with the host tier
holding all but each sequence's first block and the block it writes, 2 or 4 ring slots, prompts
of 4 full blocks); quest-k4 / quest-k8 (QUEST over the host tier, 32 blocks per sequence, top-k 4
or 8, with a reuse cache); quest-k2-gpu ... quest-k12-gpu (QUEST at top-k 2, 4, 6, 8, 12
with the same blocks and no host tier: the same picks, since the scores do not depend on the tier,
without the host tier's decode cost, for the trade-off curve); quest-k6-b256-gpu ...
quest-k24-b256-gpu (the same with 256-token blocks, 128 per 32K prompt); xattn-0.9 / xattn-0.95 / xattn-0.97 (XATTN_BSA prefill at that
threshold, no host tier).

Building the samples takes ~10 s per 32K length on one core; --make-samples saves them once
(e.g. to carry them to a GPU machine):

    python -m benchmarks.ruler_sweep --make-samples samples.pt --model DIR --lengths 4096,32768
    python -m benchmarks.ruler_sweep --samples samples.pt --model DIR --lengths 4096,32768 \\
        --settings full-gpu,xattn-0.9 --out ruler.jsonl
    python -m benchmarks.ruler_sweep --table ruler.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_ruler import RulerSettings, build_samples, run_ruler  # noqa: E402

from nanovllm import LLM  # noqa: E402
from nanovllm.kvcache.reuse import DEFAULT_ROWS_PER_PICK  # noqa: E402
from tools import ruler  # noqa: E402

SETTINGS = {
    "full-gpu": {},
    "full-host-2": dict(enable_offload=True, num_ring_slots=2, blocks=4),
    "full-host-4": dict(enable_offload=True, num_ring_slots=4, blocks=4),
    "quest-k4": dict(enable_offload=True, num_ring_slots=4, blocks=31, sparse_policy="QUEST", sparse_topk_blocks=4),
    "quest-k8": dict(enable_offload=True, num_ring_slots=4, blocks=31, sparse_policy="QUEST", sparse_topk_blocks=8),
    **{f"quest-k{k}-gpu": dict(blocks=31, sparse_policy="QUEST", sparse_topk_blocks=k) for k in (2, 4, 6, 8, 12)},
    **{f"quest-k{k}-b256-gpu": dict(block=256, sparse_policy="QUEST", sparse_topk_blocks=k) for k in (6, 8, 12, 16, 24)},
    "xattn-0.9": dict(sparse_policy="XATTN_BSA", sparse_threshold=0.9),
    "xattn-0.95": dict(sparse_policy="XATTN_BSA", sparse_threshold=0.95),
    "xattn-0.97": dict(sparse_policy="XATTN_BSA", sparse_threshold=0.97),
}
"""Name -> :class:`RulerSettings` fields (besides tasks, lengths and samples). ``blocks``: full KV
blocks a prompt spans, so that the block size grows with the length (:func:`block_size`);
``block``: a fixed block size in tokens. Decode over the host tier costs host time per block, sequence and layer
(a load and a fold), so few blocks keep a small model's decode from being host-bound
(docs/sparse.md): FULL's 4 (the first stays in the GPU tier, the next three, ~73% of the prompt,
are read from the host, and the partial last block is the one written); QUEST's 31 (plus the
partial last one: 32 blocks, so top-k 4 reads (4 + 3) / 32 = 22% of them). QUEST's reuse cache
gets the engine's default rows per pick (``DEFAULT_ROWS_PER_PICK`` x top-k per layer) for each
sequence batched (:func:`_settings`; one row per pick before session 9), so that the reuse rate
measures how much consecutive steps' picks overlap, not the cache's size."""
ANSWER_ROOM = max(ruler.MAX_NEW_TOKENS.values())
"""A length L is RULER's sequence length: prompts of L - ANSWER_ROOM tokens, so that prompt and
answer fit a model whose context is L (Qwen2.5-Coder-0.5B: 32,768)."""


def make_samples(model: str, lengths: list[int], num_samples: int, seed: int) -> dict:
    """``{length: {task: samples}}`` for every task of :data:`ruler.TASKS`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return {n: build_samples(tokenizer, RulerSettings(num_samples=num_samples, seed=seed, input_len=n - ANSWER_ROOM))
            for n in lengths}


def block_size(name: str, length: int) -> int:
    """KV block tokens of setting ``name`` at ``length``: its ``block``; else the prompt
    (``length - ANSWER_ROOM`` tokens) over ``blocks``, rounded down to a multiple of 256 (at least
    256); else 1024 (the evaluation default)."""
    setting = SETTINGS[name]
    if "block" in setting:
        return setting["block"]
    blocks = setting.get("blocks")
    return 1024 if blocks is None else max(256, (length - ANSWER_ROOM) // blocks // 256 * 256)


def _settings(name: str, length: int, tasks: list[str], num_samples: int, block: int) -> RulerSettings:
    fields = {k: v for k, v in SETTINGS[name].items() if k not in ("blocks", "block")}
    if fields.get("sparse_policy") == "QUEST":  # the default rows per pick, for each batched sequence
        fields["num_reuse_cache_blocks"] = DEFAULT_ROWS_PER_PICK * fields["sparse_topk_blocks"] * num_samples
    settings = RulerSettings(tasks=tasks, num_samples=num_samples, input_len=length - ANSWER_ROOM,
                             max_num_seqs=num_samples, block_size=block, **fields)
    settings.validate()
    return settings


def _line(name: str, length: int, report, seconds: float) -> dict:
    stats = report.sparse_stats or {}
    return {"setting": name, "input_len": length, "num_samples": len(report.results[0].scores),
            "overall": round(report.overall, 4), "tasks": {r.task: round(r.mean, 4) for r in report.results},
            "prefill_density": stats.get("prefill", {}).get("density"),
            "prefill_comm_density": stats.get("prefill", {}).get("comm_density"),
            "decode_density": stats.get("decode", {}).get("density"),
            "decode_comm_density": stats.get("decode", {}).get("comm_density"),
            "decode_reuse_rate": stats.get("decode", {}).get("reuse_rate"),
            "generate_seconds": round(seconds, 1), "offload": report.offload, "dtype": report.dtype,
            "block_size": report.settings["block_size"],
            "outputs": {r.task: [o[:80] for o, s in zip(r.outputs, r.scores) if s < 1][:3] for r in report.results}}


def run_setting(model: str, name: str, samples: dict, num_samples: int):
    """Setting ``name`` at every length, the longest first; one engine per block size (so one for
    the settings without ``blocks``), sized for its longest length. Yields the JSON line of each
    length in turn (see the module docstring)."""
    lengths = sorted(samples, reverse=True)  # the longest first: the one that matters most
    tasks = list(samples[lengths[0]])
    for block in dict.fromkeys(block_size(name, n) for n in lengths):
        group = [n for n in lengths if block_size(name, n) == block]
        llm = LLM(model, **_settings(name, group[0], tasks, num_samples, block).engine_kwargs())
        try:
            for length in group:
                t0 = time.perf_counter()
                report = run_ruler(llm, _settings(name, length, tasks, num_samples, block), samples[length])
                yield _line(name, length, report, time.perf_counter() - t0)
        finally:
            llm.shutdown()


def sweep(args) -> None:
    samples = torch.load(args.samples) if args.samples else make_samples(args.model, args.lengths,
                                                                         args.num_samples, args.seed)
    samples = {n: samples[n] for n in args.lengths}
    for name in args.settings:
        try:
            for line in run_setting(args.model, name, samples, args.num_samples):
                _write(args.out, line)
        except Exception as err:  # record it; the other settings go on
            _write(args.out, {"setting": name, "error": f"{type(err).__name__}: {err}"})


def _write(path: str, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps({k: v for k, v in line.items() if k != "outputs"}), flush=True)


def table(path: str) -> str:
    """The Markdown table of a sweep's JSON lines: a row per (setting, length), a column per task."""
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    runs = [x for x in lines if "error" not in x]
    tasks = [t for t in ruler.TASKS if any(t in x["tasks"] for x in runs)]

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    head = ["setting", "length", *tasks, "average", "prefill density", "decode density", "decode comm density",
            "reuse rate", "seconds"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in sorted(runs, key=lambda x: (list(SETTINGS).index(x["setting"]), x["input_len"])):
        cells = [x["setting"], str(x["input_len"]), *(f"{100 * x['tasks'][t]:.0f}" for t in tasks),
                 f"**{100 * x['overall']:.1f}**", fmt(x["prefill_density"]), fmt(x.get("decode_density")),
                 fmt(x["decode_comm_density"]),
                 fmt(x.get("decode_reuse_rate")), f"{x['generate_seconds']:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    rows += [f"\nfailed: {x['setting']}: {x['error']}" for x in lines if "error" in x]
    return "\n".join(rows)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ruler_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the model directory (its tokenizer builds the samples)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384, 32768],
                   help="comma-separated sequence lengths (default 4096,8192,16384,32768)")
    p.add_argument("--num-samples", type=int, default=10, help="samples per task and length (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    p.add_argument("--settings", type=_names, default=list(SETTINGS),
                   help=f"comma-separated settings (default all: {','.join(SETTINGS)})")
    p.add_argument("--samples", help="samples saved by --make-samples (default: build them)")
    p.add_argument("--make-samples", metavar="PATH", help="only build the samples (all 12 tasks) and save them")
    p.add_argument("--out", default="ruler_sweep.jsonl", help="JSON lines appended here (default ruler_sweep.jsonl)")
    p.add_argument("--table", metavar="JSONL", help="only print the Markdown table of a sweep's lines")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
    elif not args.model:
        p.error("--model is required")
    elif args.make_samples:
        torch.save(make_samples(args.model, args.lengths, args.num_samples, args.seed), args.make_samples)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
