"""RULER over sequence lengths and sparse-decode settings, each paired with FULL on the same
samples: one JSON line per (setting, length), then the tables.

For every setting at every length (--lengths: RULER's sequence length, prompt plus answer;
prompts have LENGTH - 128 tokens) the evaluation of tools/ruler/evaluation.py runs: one greedy generate
per task with all of its samples batched (--num-samples, 20 by default), scored with RULER's
metric. Every setting reads the same samples: they are built once per length (or loaded with
--samples) and each line records a digest of every task's samples, which the pairing checks. Each
(setting, length) appends one JSON line to --out: every task's per-sample scores and mean, the
average over tasks, the engine's policy options, the sparse densities (LLM.get_sparse_stats; the
decode's density, comm density and reuse rate also per layer) and the generate time. A setting
that fails is recorded with its error and the sweep goes on. At the end (or with --table) the
lines are printed as two Markdown tables: per-task and average scores with the paired difference
of the average against FULL (same length, same samples) and its standard error, then the paired
difference of every task.

Paired difference: for task t with samples i, d_ti = score(setting)_ti - score(FULL)_ti; a
task's difference is mean_i d_ti with standard error sd_i(d_ti) / sqrt(n_t); the average's is
the mean over the T tasks, with standard error sqrt(sum_t se_t^2) / T (the tasks' samples are
independent).

Settings, by name:

    full                              FULL, no host tier: the baseline of every pairing
    quest-p{P}-b{B}-{max|sum}-d{D}    QUEST: pages of P tokens (16, 32, 64), a budget of B tokens
                                      per KV head and step, group score max or sum, the first D
                                      layers dense, pages scored by Quest's bound (radius weight 1)
    quest-p{P}-b{B}-{max|sum}-w{W}-d{D}   the same with the radius weight W in [0, 1] (the engine's
                                      default: 0.5)
    moments-p{P}-b{B}-{max|sum}-d{D}  MOMENTS: QUEST's options, pages chosen by a Gaussian estimate of
                                      their attention mass from their keys' mean and variance
    oracle-p{P}-b{B}-{max|sum}-d{D}   ORACLE: QUEST's options, pages chosen by their exact attention
                                      mass (the ceiling of any page selector at that budget)
    streaming-p{P}-d{D}               STREAMING: sinks and the recent window only
    ...-d{D}-lw...                    (QUEST / MOMENTS / ORACLE) the budget shared by layer with the
                                      weights of --layer-budget-weights (sparse_layer_budget_weights)
    ...-s{S}-r{R}                     (QUEST / ORACLE / STREAMING) S sink and R recent tokens instead of
                                      --sink-tokens / --recent-tokens
    ...-host                          (QUEST / ORACLE / STREAMING) over the host tier: 2 GPU-tier blocks per
                                      sequence, the rest on the host, the reuse cache with the
                                      engine's default cells per pick for each batched sequence
    full-host                         FULL over the host tier (2 GPU-tier blocks per sequence, the
                                      engine's default ring: a layer's blocks folded in groups)
    full-host-{N}                     FULL over the host tier with N ring slots, prompts of 4
                                      blocks (the block size grows with the length)
    xattn-{T}                         XATTN_BSA prefill at threshold T, no host tier
    ...-fp8                           (any of the above) the KV cache in fp8 e4m3 (kv_cache_dtype)

Without --settings the grid names them: FULL, and for --policies (QUEST, STREAMING) the values
of --page-sizes, --budgets, --group-scores, --radius-weights and --dense-layers (STREAMING takes
only the page size and the dense layers), over the host tier with --host-tier. --design oat (the
default) varies one option at a time from the base, the first value of each list (by default the
engine's defaults: p16, 2944 tokens, sum, radius weight 0.5, 0 dense layers: 8 QUEST rows, 4
STREAMING rows); --design full crosses them all (72 QUEST rows, 6 STREAMING rows by default).
--list prints the names and exits.

Building the samples takes ~10 s per 32K length on one core; --make-samples saves them once
(e.g. to carry them to a GPU machine):

    python -m benchmarks.ruler_sweep --make-samples samples.pt --model DIR --lengths 4096,32768
    python -m benchmarks.ruler_sweep --samples samples.pt --model DIR --lengths 4096,32768 --out ruler.jsonl
    python -m benchmarks.ruler_sweep --samples samples.pt --model DIR --lengths 32768 --design full \\
        --page-sizes 16,32,64 --budgets 2048,1024,4096 --group-scores max,sum --dense-layers 0,2
    python -m benchmarks.ruler_sweep --settings full,quest-p32-b1024-sum-d2-host,xattn-0.9 --model DIR
    python -m benchmarks.ruler_sweep --samples samples.pt --model DIR --lengths 32768 --jobs 4 \\
        --settings full,quest-p16-b2048-max-d0,quest-p32-b2048-max-d0,streaming-p16-d0
    python -m benchmarks.ruler_sweep --table ruler.jsonl [more.jsonl ...]

--jobs N runs the settings in N processes sharing the GPU (each with 1/N of
--gpu-memory-utilization): a small model's decode under a choosing policy is host-bound, so
settings side by side finish sooner; the lines are appended to --out in the order of --settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.kvcache.reuse import DEFAULT_ROWS_PER_PICK
from nanovllm.sparse import policy_class
from tools import ruler
from tools.eval_engine import sparse_options
from tools.ruler.evaluation import RulerSettings, build_samples, run_ruler

ANSWER_ROOM = max(ruler.MAX_NEW_TOKENS.values())
"""A length L is RULER's sequence length: prompts of L - ANSWER_ROOM tokens, so that prompt and
answer fit a model whose context is L (Qwen2.5-Coder-0.5B: 32,768)."""
BASELINE = "full"
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
QUEST_BOUND = 1.0
"""The radius weight of a QUEST name without ``-w<W>``: Quest's upper bound, whatever the engine's
default, so that a name means one setting in every sweep's lines."""
DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS = _ENGINE_DEFAULTS["sparse_sink_tokens"], _ENGINE_DEFAULTS["sparse_recent_tokens"]
"""The engine's ``sparse_sink_tokens`` / ``sparse_recent_tokens`` defaults: a name gives its own
only when they differ (``-s<S>-r<R>``)."""
FULL_HOST_BLOCKS = 4
"""``full-host-N``: full KV blocks a prompt spans (the first stays in the GPU tier, the next three
are read from the host through the ring, the partial last one is the one written): decode over the
ring costs host time per block, sequence and layer, so few blocks keep a small model's decode from
being host-bound."""

_CHOOSING = re.compile(r"(?P<policy>quest|moments|oracle|streaming)-p(?P<page>\d+)"
                       r"(?:-b(?P<budget>\d+)-(?P<score>max|sum)(?:-w(?P<weight>[01](?:\.\d+)?))?)?"
                       r"-d(?P<dense>\d+)(?P<by_layer>-lw)?(?:-s(?P<sink>\d+)-r(?P<recent>\d+))?(?P<host>-host)?")
_FULL_HOST = re.compile(r"full-host(?:-(?P<slots>\d+))?")
_XATTN = re.compile(r"xattn-(?P<threshold>[0-9]*\.?[0-9]+)")
FP8_SUFFIX = "-fp8"
"""A setting's name ending in it: the same setting with ``kv_cache_dtype="fp8_e4m3"``."""


# ---- settings ----------------------------------------------------------------------------
def setting_fields(name: str, sink_tokens: int = DEFAULT_SINK_TOKENS,
                   recent_tokens: int = DEFAULT_RECENT_TOKENS) -> dict:
    """:class:`RulerSettings` fields of setting ``name`` (the module docstring's grammar), with
    ``"blocks"`` (full blocks a prompt spans, sizing the block) for ``full-host-N``.
    ``sink_tokens`` / ``recent_tokens``: a choosing setting's always-read tokens unless its name
    gives them. A ``-lw`` setting has ``"by_layer": True`` (:func:`make_settings` adds the weights).

    Raises:
        ValueError: a name outside the grammar.
    """
    if name.endswith(FP8_SUFFIX):
        return setting_fields(name[:-len(FP8_SUFFIX)], sink_tokens, recent_tokens) | {"kv_cache_dtype": "fp8_e4m3"}
    if name == BASELINE:
        return {}
    if m := _FULL_HOST.fullmatch(name):
        if m["slots"] is None:
            return dict(enable_offload=True)
        return dict(enable_offload=True, num_ring_slots=int(m["slots"]), blocks=FULL_HOST_BLOCKS)
    if m := _XATTN.fullmatch(name):
        return dict(sparse_policy="XATTN_BSA", sparse_threshold=float(m["threshold"]))
    m = _CHOOSING.fullmatch(name)
    options = () if m is None else policy_class(m["policy"]).options
    takes_budget = "sparse_token_budget" in options
    if m is None or takes_budget != (m["budget"] is not None) or (m["by_layer"] and not m["budget"]):
        raise ValueError(f"unknown setting {name!r}: expected full, <quest|moments|oracle>-p<P>-b<B>-<max|sum>-d<D>"
                         f"[-lw][-s<S>-r<R>][-host], streaming-p<P>-d<D>[-s<S>-r<R>][-host], full-host[-<N>] or xattn-<T>, "
                         f"each optionally ending in {FP8_SUFFIX}")
    fields = dict(sparse_policy=m["policy"].upper(), sparse_page_size=int(m["page"]),
                  sparse_dense_layers=int(m["dense"]),
                  sparse_sink_tokens=int(m["sink"]) if m["sink"] else sink_tokens,
                  sparse_recent_tokens=int(m["recent"]) if m["recent"] else recent_tokens)
    if m["budget"] is not None:
        fields.update(sparse_token_budget=int(m["budget"]), sparse_group_score=m["score"])
        if m["weight"] is not None and "sparse_radius_weight" not in options:
            raise ValueError(f"unknown setting {name!r}: -w<W> (the radius weight) is not an option of "
                             f"{m['policy'].upper()}")
        if "sparse_radius_weight" in options:
            fields["sparse_radius_weight"] = QUEST_BOUND if m["weight"] is None else float(m["weight"])
        if m["by_layer"]:
            fields["by_layer"] = True
    if m["host"]:
        fields.update(enable_offload=True)
    return fields


def choosing_name(policy: str, page: int, dense: int, budget: int | None = None, score: str | None = None,
                  sink: int = DEFAULT_SINK_TOKENS, recent: int = DEFAULT_RECENT_TOKENS, host: bool = False,
                  weight: float = QUEST_BOUND) -> str:
    """The name of a QUEST (``budget``, ``score`` and ``weight``, its radius weight, given) or
    STREAMING setting."""
    name = f"{policy.lower()}-p{page}" + (f"-b{budget}-{score}" if budget is not None else "")
    name += (f"-w{weight:g}" if weight != QUEST_BOUND else "") + f"-d{dense}"
    if (sink, recent) != (DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS):
        name += f"-s{sink}-r{recent}"
    return name + ("-host" if host else "")


def grid(policies: list[str], pages: list[int], budgets: list[int], scores: list[str], dense: list[int],
         design: str, sink: int = DEFAULT_SINK_TOKENS, recent: int = DEFAULT_RECENT_TOKENS,
         host: bool = False, weights: list[float] = (QUEST_BOUND,)) -> list[str]:
    """FULL, then the QUEST and STREAMING rows of the grid (module docstring): ``design`` "oat"
    varies one option at a time from the first value of each list, "full" crosses them."""
    axes = [pages, budgets, scores, dense, list(weights)]
    if design == "full":
        points = list(itertools.product(*axes))
    else:
        base = [axis[0] for axis in axes]
        points = [tuple(base)] + [tuple(value if i == j else b for j, b in enumerate(base))
                                  for i, axis in enumerate(axes) for value in axis[1:]]
    names = [BASELINE]
    for policy in policies:
        options = policy_class(policy).options
        for page, budget, score, layers, weight in points:
            if "sparse_token_budget" in options:
                names.append(choosing_name(policy, page, layers, budget, score, sink, recent, host,
                                           weight if "sparse_radius_weight" in options else QUEST_BOUND))
            else:  # no budget, no group score (STREAMING)
                names.append(choosing_name(policy, page, layers, sink=sink, recent=recent, host=host))
    return list(dict.fromkeys(names))


def block_size(name: str, length: int, default: int) -> int:
    """KV block tokens of setting ``name`` at ``length``: for ``full-host-N`` the prompt
    (``length - ANSWER_ROOM`` tokens) over :data:`FULL_HOST_BLOCKS` blocks, rounded down to a
    multiple of 256 (at least 256); else ``default``."""
    blocks = setting_fields(name).get("blocks")
    return default if blocks is None else max(256, (length - ANSWER_ROOM) // blocks // 256 * 256)


def make_settings(name: str, length: int, tasks: list[str], num_samples: int, block: int, sink: int, recent: int,
                  device: str = "auto", gpu_memory_utilization: float | None = None,
                  layer_weights: list[float] | None = None) -> RulerSettings:
    """The validated evaluation of ``name`` at ``length`` (all ``num_samples`` samples of a task
    batched). A QUEST / ORACLE ``-host`` setting's reuse cache gets the engine's default cells per pick
    (``DEFAULT_ROWS_PER_PICK`` per picked page and KV head) for each batched sequence, so that the
    reuse rate measures how much consecutive steps' picks overlap, not the cache's size. A ``-lw``
    setting reads ``layer_weights`` (``sparse_layer_budget_weights``).

    Raises:
        ValueError: a bad setting, or a ``-lw`` setting without ``layer_weights``.
    """
    fields = {k: v for k, v in setting_fields(name, sink, recent).items() if k != "blocks"}
    if fields.pop("by_layer", False):
        if layer_weights is None:
            raise ValueError(f"setting {name!r} shares its budget by layer: give --layer-budget-weights")
        fields["sparse_layer_budget_weights"] = tuple(layer_weights)
    if "sparse_token_budget" in fields and fields.get("enable_offload"):
        picks = policy_class(fields["sparse_policy"]).decode_pick_limit(
            SimpleNamespace(**{"sparse_layer_budget_weights": None, "max_model_len": length, **fields}))
        fields["num_reuse_cache_blocks"] = math.ceil(DEFAULT_ROWS_PER_PICK * picks * num_samples / block)
    settings = RulerSettings(tasks=tasks, num_samples=num_samples, input_len=length - ANSWER_ROOM,
                             max_num_seqs=num_samples, block_size=block, device=device,
                             gpu_memory_utilization=gpu_memory_utilization, **fields)
    settings.validate()
    return settings


# ---- samples -----------------------------------------------------------------------------
def make_samples(model: str, lengths: list[int], num_samples: int, seed: int, tasks: list[str]) -> dict:
    """``{length: {task: samples}}``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return {n: build_samples(tokenizer, RulerSettings(tasks=tasks, num_samples=num_samples, seed=seed,
                                                      input_len=n - ANSWER_ROOM)) for n in lengths}


def load_samples(path: str, lengths: list[int], num_samples: int, tasks: list[str]) -> dict:
    """The first ``num_samples`` samples of ``tasks`` at ``lengths`` from a --make-samples file.

    Raises:
        ValueError: a length, task or sample the file lacks.
    """
    saved = torch.load(path)
    out = {}
    for n in lengths:
        if n not in saved:
            raise ValueError(f"{path} has no samples of length {n} (it has {sorted(saved)})")
        out[n] = {}
        for task in tasks:
            have = saved[n].get(task, [])
            if len(have) < num_samples:
                raise ValueError(f"{path} has {len(have)} samples of {task} at length {n}, fewer than "
                                 f"--num-samples {num_samples}")
            out[n][task] = have[:num_samples]
    return out


def samples_digest(samples: list[dict]) -> str:
    """A digest of a task's samples (their prompt ids and answers): equal digests, same samples."""
    text = json.dumps([[list(s["input_ids"]), s["answers"]] for s in samples])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# ---- the sweep -----------------------------------------------------------------------------
def _line(name: str, length: int, report, seconds: float, samples: dict, options: dict) -> dict:
    stats = report.sparse_stats or {}
    prefill, decode = stats.get("prefill", {}), stats.get("decode", {})
    return {"setting": name, "input_len": length, "num_samples": len(report.results[0].scores),
            "policy": stats.get("policy"), "options": options,
            "overall": round(report.overall, 4), "tasks": {r.task: round(r.mean, 4) for r in report.results},
            "scores": {r.task: r.scores for r in report.results},
            "samples_digest": {r.task: samples_digest(samples[r.task]) for r in report.results},
            "prefill_density": prefill.get("density"), "prefill_comm_density": prefill.get("comm_density"),
            "decode_density": decode.get("density"), "decode_comm_density": decode.get("comm_density"),
            "decode_reuse_rate": decode.get("reuse_rate"),
            "decode_per_layer": [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                                 for row in decode.get("per_layer", [])],
            "decode_read_tokens": decode.get("read_tokens"), "decode_context_tokens": decode.get("context_tokens"),
            "generate_seconds": round(seconds, 1), "offload": report.offload, "dtype": report.dtype,
            "kv_cache_dtype": report.settings.get("kv_cache_dtype", "auto"),
            "block_size": report.settings["block_size"],
            "outputs": {r.task: [o[:80] for o, s in zip(r.outputs, r.scores) if s < 1][:3] for r in report.results}}


def run_setting(model: str, name: str, samples: dict, num_samples: int, default_block: int, sink: int, recent: int,
                device: str = "auto", gpu_memory_utilization: float | None = None,
                layer_weights: list[float] | None = None):
    """Setting ``name`` at every length, the longest first; one engine per block size (so one for
    all but ``full-host-N``), sized for its longest length. Yields the JSON line of each length in
    turn (see the module docstring)."""
    lengths = sorted(samples, reverse=True)  # the longest first: the one that matters most
    tasks = list(samples[lengths[0]])
    for block in dict.fromkeys(block_size(name, n, default_block) for n in lengths):
        group = [n for n in lengths if block_size(name, n, default_block) == block]
        settings = make_settings(name, group[0], tasks, num_samples, block, sink, recent, device,
                                 gpu_memory_utilization, layer_weights)
        llm = LLM(model, **settings.engine_kwargs())
        try:
            options = sparse_options(llm)
            for length in group:
                t0 = time.perf_counter()
                report = run_ruler(llm, make_settings(name, length, tasks, num_samples, block, sink, recent, device,
                                                      gpu_memory_utilization, layer_weights), samples[length])
                yield _line(name, length, report, time.perf_counter() - t0, samples[length], options)
        finally:
            llm.shutdown()


def sweep(args) -> None:
    """Run every setting (here, or in ``--jobs`` processes: :func:`run_in_jobs`), appending its
    lines to ``--out``, then print the tables.

    Raises:
        RuntimeError: a job exited with an error (after the others' lines and the tables).
    """
    failed = run_in_jobs(args) if args.jobs > 1 else run_here(args)
    if not args.no_table:
        print()
        print(table(args.out))
    if failed:
        raise RuntimeError(f"ruler_sweep jobs failed: {', '.join(failed)}")


def run_here(args) -> list[str]:
    """Every setting in this process; a setting that fails is recorded as an error line. Returns
    no failed jobs."""
    if args.samples:
        samples = load_samples(args.samples, args.lengths, args.num_samples, args.tasks)
    else:
        samples = make_samples(args.model, args.lengths, args.num_samples, args.seed, args.tasks)
    for name in args.settings:
        try:
            for line in run_setting(args.model, name, samples, args.num_samples, args.block_size, args.sink_tokens,
                                    args.recent_tokens, args.device, args.gpu_memory_utilization,
                                    args.layer_weights):
                _write(args.out, line)
        except Exception as err:  # record it; the other settings go on
            _write(args.out, {"setting": name, "error": f"{type(err).__name__}: {err}"})
    return []


def job_split(settings: list[str], jobs: int) -> list[list[str]]:
    """``settings`` dealt round-robin to at most ``jobs`` jobs (none empty), so that the first
    settings (FULL among them) start at once."""
    return [part for part in (settings[k::jobs] for k in range(jobs)) if part]


def job_argv(args, names: list[str], samples: str, out: str, utilization: float) -> list[str]:
    """The command line of one job of :func:`run_in_jobs`: this sweep's options for ``names``,
    reading ``samples``, appending to ``out``, with ``utilization`` of the GPU, no table."""
    return [sys.executable, "-m", "benchmarks.ruler_sweep", "--model", args.model, "--samples", samples,
            "--lengths", ",".join(map(str, args.lengths)), "--num-samples", str(args.num_samples),
            "--tasks", ",".join(args.tasks), "--settings", ",".join(names),
            "--sink-tokens", str(args.sink_tokens), "--recent-tokens", str(args.recent_tokens),
            "--block-size", str(args.block_size), "--device", args.device,
            "--gpu-memory-utilization", f"{utilization:.4f}", "--out", out, "--no-table",
            *(("--layer-budget-weights", args.layer_budget_weights) if args.layer_budget_weights else ())]


def run_in_jobs(args) -> list[str]:
    """The settings in ``args.jobs`` child processes sharing the device, each with an equal share
    of ``--gpu-memory-utilization`` (the engine's default when not given) and its own JSON-lines
    file (``OUT.jobK``, its log ``OUT.jobK.log``); then every line is appended to ``--out`` in the
    order of ``--settings``. The samples are built once (unless ``--samples`` gives them) and saved
    beside ``--out``. Returns the logs of the jobs that exited with an error."""
    import subprocess

    samples = args.samples
    if samples is None:
        samples = f"{args.out}.samples.pt"
        torch.save(make_samples(args.model, args.lengths, args.num_samples, args.seed, args.tasks), samples)
    share = (args.gpu_memory_utilization or _ENGINE_DEFAULTS["gpu_memory_utilization"]) / args.jobs
    root = str(Path(__file__).resolve().parents[1])
    procs = []
    for k, names in enumerate(job_split(args.settings, args.jobs)):
        out = f"{args.out}.job{k}"
        Path(out).unlink(missing_ok=True)
        with open(f"{out}.log", "w") as log:
            procs.append((out, subprocess.Popen(job_argv(args, names, samples, out, share), cwd=root,
                                                stdout=log, stderr=subprocess.STDOUT)))
    codes = [proc.wait() for _, proc in procs]
    lines = read_lines([out for out, _ in procs if Path(out).exists()])
    for name in args.settings:
        for line in lines:
            if line["setting"] == name:
                _write(args.out, line)
    return [f"{out}.log (exit {code})" for (out, _), code in zip(procs, codes) if code != 0]


def _write(path: str, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps({k: v for k, v in line.items() if k not in ("outputs", "scores", "samples_digest")}), flush=True)


# ---- the tables -----------------------------------------------------------------------------
def paired_difference(line: dict, full: dict) -> tuple[dict, tuple[float, float | None] | None]:
    """``({task: (mean difference, standard error)}, (average's difference, its standard
    error))`` of ``line`` against ``full`` over the tasks both ran on the same samples (module
    docstring); a standard error is None for a task of one sample, the average None without a
    common task."""
    per_task = {}
    for task, scores in line["scores"].items():
        base = full["scores"].get(task)
        if base is None or line["samples_digest"].get(task) != full["samples_digest"].get(task):
            continue
        d = [a - b for a, b in zip(scores, base)]
        n = len(d)
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else None
        per_task[task] = (mean, se)
    if not per_task:
        return per_task, None
    diff = sum(m for m, _ in per_task.values()) / len(per_task)
    ses = [se for _, se in per_task.values()]
    se = None if None in ses else math.sqrt(sum(s * s for s in ses)) / len(per_task)
    return per_task, (diff, se)


def _baseline(line: dict, fulls: list[dict]) -> dict | None:
    """The last FULL line of ``line``'s length whose samples of every task of ``line`` match."""
    for full in reversed(fulls):
        if full["input_len"] == line["input_len"] and all(
                full["samples_digest"].get(t) == d for t, d in line["samples_digest"].items()):
            return full
    return None


def _pm(value: tuple[float, float | None] | None, scale: float = 100.0) -> str:
    if value is None:
        return "-"
    diff, se = value
    return f"{scale * diff:+.1f}" + ("" if se is None else f" ± {scale * se:.1f}")


def read_lines(paths: str | list[str]) -> list[dict]:
    """The JSON lines of one or more sweep files, in order; a line that repeats an earlier one's
    setting, length, samples and per-sample scores (the same run recorded again, e.g. a FULL
    baseline in two files) is kept once.

    Raises:
        FileNotFoundError: a path that does not exist (named).
    """
    lines, seen = [], set()
    for path in [paths] if isinstance(paths, str) else paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no sweep file {path}")
        for text in Path(path).read_text().splitlines():
            if not text.strip():
                continue
            line = json.loads(text)
            key = json.dumps([line.get(k) for k in ("setting", "input_len", "samples_digest", "scores", "error")])
            if key not in seen:
                seen.add(key)
                lines.append(line)
    return lines


def table(paths: str | list[str]) -> str:
    """The Markdown tables of a sweep's JSON lines (module docstring; :func:`read_lines`): a row
    per (setting, length), sorted by length, FULL first, then the settings in the order they ran."""
    lines = read_lines(paths)
    runs = [x for x in lines if "error" not in x]
    order = list(dict.fromkeys([BASELINE] + [x["setting"] for x in runs]))
    runs.sort(key=lambda x: (x["input_len"], order.index(x["setting"])))
    tasks = [t for t in ruler.TASKS if any(t in x["tasks"] for x in runs)]
    fulls = [x for x in lines if x.get("setting") == BASELINE and "error" not in x and "scores" in x]

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    head = ["setting", "length", *tasks, "average", "vs FULL (± SE)", "decode density", "decode comm density",
            "reuse rate", "seconds"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    diff_head = ["setting", "length", *tasks, "average"]
    diff_rows = ["| " + " | ".join(diff_head) + " |", "|" + "---|" * len(diff_head)]
    for x in runs:
        full = _baseline(x, fulls) if x["setting"] != BASELINE and "scores" in x else None
        per_task, average = paired_difference(x, full) if full is not None else ({}, None)
        cells = [x["setting"], str(x["input_len"]),
                 *(f"{100 * x['tasks'][t]:.0f}" if t in x["tasks"] else "-" for t in tasks),
                 f"**{100 * x['overall']:.1f}**", "(baseline)" if x["setting"] == BASELINE else _pm(average),
                 fmt(x.get("decode_density")), fmt(x.get("decode_comm_density")), fmt(x.get("decode_reuse_rate")),
                 f"{x['generate_seconds']:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
        if x["setting"] != BASELINE:
            diff_rows.append("| " + " | ".join([x["setting"], str(x["input_len"]),
                                                *(_pm(per_task.get(t)) for t in tasks), _pm(average)]) + " |")
    out = ["Scores (%, mean over samples; average: mean over tasks) and the paired difference of the average "
           "against FULL (percentage points ± standard error):", "", *rows]
    if len(diff_rows) > 2:
        out += ["", "Paired difference against FULL per task (percentage points ± standard error; - : no FULL line "
                "on the same samples):", "", *diff_rows]
    out += [f"\nfailed: {x['setting']}: {x['error']}" for x in lines if "error" in x]
    return "\n".join(out)


# ---- command line ---------------------------------------------------------------------------
def _numbers(kind: type, what: str):
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


_ints, _floats = _numbers(int, "integers"), _numbers(float, "numbers")


def _words(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values of {list(choices)}, got {text!r}")
        return values
    return parse


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated setting names")
    for name in names:
        try:
            setting_fields(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return list(dict.fromkeys(names))


def _tasks(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return list(ruler.TASKS)
    try:
        return list(dict.fromkeys(ruler.resolve_task(t.strip()) for t in text.split(",") if t.strip()))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ruler_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the model directory (its tokenizer builds the samples)")
    p.add_argument("--lengths", type=_ints, default=[4096, 8192, 16384, 32768],
                   help="comma-separated sequence lengths (default 4096,8192,16384,32768)")
    p.add_argument("--num-samples", type=int, default=20, help="samples per task and length (default 20)")
    p.add_argument("--tasks", type=_tasks, default=list(ruler.TASKS), help="'all' (default) or comma-separated tasks")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    p.add_argument("--settings", type=_names, default=None,
                   help="comma-separated setting names (module docstring); default: the grid's")
    p.add_argument("--policies", type=_words(("QUEST", "STREAMING")), default=["QUEST", "STREAMING"],
                   help="grid: the choosing policies besides FULL (default QUEST,STREAMING)")
    p.add_argument("--page-sizes", type=_ints, default=[16, 32, 64], help="grid: sparse_page_size (default 16,32,64)")
    budgets = [_ENGINE_DEFAULTS["sparse_token_budget"], 1024, 4096]
    scores = sorted(("max", "sum"), key=lambda score: score != _ENGINE_DEFAULTS["sparse_group_score"])
    weights = [_ENGINE_DEFAULTS["sparse_radius_weight"], QUEST_BOUND]
    p.add_argument("--budgets", type=_ints, default=budgets,
                   help=f"grid: QUEST's sparse_token_budget (default {','.join(map(str, budgets))})")
    p.add_argument("--group-scores", type=_words(("max", "sum")), default=scores,
                   help=f"grid: QUEST's sparse_group_score (default {','.join(scores)})")
    p.add_argument("--radius-weights", type=_floats, default=weights,
                   help=f"grid: QUEST's sparse_radius_weight, each in [0, 1] (default {','.join(f'{w:g}' for w in weights)})")
    p.add_argument("--dense-layers", type=_ints, default=[0, 2], help="grid: sparse_dense_layers (default 0,2)")
    p.add_argument("--design", choices=("oat", "full"), default="oat",
                   help="grid: one option at a time from the first values (default), or every combination")
    p.add_argument("--host-tier", action="store_true", help="grid: the QUEST / STREAMING rows over the host tier")
    p.add_argument("--sink-tokens", type=int, default=DEFAULT_SINK_TOKENS,
                   help=f"sparse_sink_tokens of every QUEST / STREAMING row (default {DEFAULT_SINK_TOKENS})")
    p.add_argument("--recent-tokens", type=int, default=DEFAULT_RECENT_TOKENS,
                   help=f"sparse_recent_tokens of every QUEST / STREAMING row (default {DEFAULT_RECENT_TOKENS})")
    p.add_argument("--layer-budget-weights", metavar="JSON",
                   help="the weights of the -lw settings: benchmarks/layer_budgets.py's report (its \"weights\")")
    p.add_argument("--block-size", type=int, default=1024,
                   help="KV block tokens of every setting but full-host-N (default 1024)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the GPU the sweep may use (default: the engine's); --jobs share it")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the settings in this many processes on one device (default 1): a small model's "
                        "decode is host-bound, so settings run side by side finish sooner")
    p.add_argument("--no-table", action="store_true", help="do not print the tables at the end")
    p.add_argument("--samples", help="samples saved by --make-samples (default: build them)")
    p.add_argument("--make-samples", metavar="PATH", help="only build the samples of --tasks and save them")
    p.add_argument("--out", default="ruler_sweep.jsonl", help="JSON lines appended here (default ruler_sweep.jsonl)")
    p.add_argument("--table", metavar="JSONL", nargs="+",
                   help="only print the tables of the lines of these sweep files (a repeated run shown once)")
    p.add_argument("--list", action="store_true",
                   help="only print the settings the sweep would run (with --jobs, each job's)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.table:
        try:
            print(table(args.table))
        except FileNotFoundError as err:
            p.error(str(err))
        return
    if args.num_samples < 1 or min(args.lengths) <= ANSWER_ROOM:
        p.error(f"--num-samples must be >= 1 and every length > {ANSWER_ROOM}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    args.layer_weights = None
    if args.layer_budget_weights:
        with open(args.layer_budget_weights) as f:
            args.layer_weights = json.load(f)["weights"]
    if args.settings is None:
        args.settings = grid(args.policies, args.page_sizes, args.budgets, args.group_scores, args.dense_layers,
                             args.design, args.sink_tokens, args.recent_tokens, args.host_tier, args.radius_weights)
    longest = max(args.lengths)
    for name in args.settings:  # every setting's options, checked before any model is loaded
        try:
            make_settings(name, longest, args.tasks, args.num_samples, block_size(name, longest, args.block_size),
                          args.sink_tokens, args.recent_tokens, args.device, args.gpu_memory_utilization,
                          args.layer_weights)
        except ValueError as err:
            p.error(f"setting {name}: {err}")
    if args.list:
        print("\n".join(args.settings) if args.jobs == 1 else "\n".join(
            f"job {k}: {', '.join(names)}" for k, names in enumerate(job_split(args.settings, args.jobs))))
    elif not args.model:
        p.error("--model is required")
    elif args.make_samples:
        torch.save(make_samples(args.model, args.lengths, args.num_samples, args.seed, args.tasks), args.make_samples)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
