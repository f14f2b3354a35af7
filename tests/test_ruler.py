#!/usr/bin/env python
"""RULER-style long-context evaluation: synthetic retrieval, tracking and aggregation tasks.

Both a pytest module and the command line of :func:`tools.ruler.evaluation.run_ruler` (the evaluation,
which ``benchmarks/ruler_sweep.py`` runs too).

The prompts come from :func:`tools.ruler.generate_samples` (needle-in-a-haystack with
numbers, words and UUIDs, multi-key needles in essay filler or in a haystack of distractor
needles, multi-value / multi-query needles, variable tracking,
common-words and frequent-words extraction), each exactly ``--input-len`` tokens with the model's
chat template. Every task's samples go through ``LLM.generate`` greedily in one call, and each
output is scored with RULER's metric (:func:`tools.ruler.score`: the fraction of the
reference strings contained in the output).

Command line (the model defaults to SmolLM2-135M-Instruct, fetched once with
:func:`nanovllm.fetch.fetch_model`)::

    python tests/test_ruler.py --tasks all --num-samples 5 --input-len 4096 \\
        --enable-offload --block-size 1024 --num-ring-slots 2 --sparse-policy FULL
    python tests/test_ruler.py --tasks all --num-samples 5 --input-len 4096 \\
        --enable-offload --block-size 1024 --num-ring-slots 2 --sparse-policy XATTN_BSA --sparse-threshold 0.9
    python tests/test_ruler.py --tasks all --num-samples 5 --input-len 4096 --max-num-seqs 5 \\
        --sparse-policy QUEST --sparse-page-size 32 --sparse-token-budget 1024 --sparse-group-score sum
    python tests/test_ruler.py --model DIR --device cuda --dtype bfloat16 --tasks vt,cwe ...

It prints a per-task table (task, samples, mean score, seconds), the overall mean (the mean
of the per-task means, as RULER averages tasks) and the sparse policy's densities, optionally
writes everything as JSON (``--json-output PATH``: settings, per-sample outputs, answers, scores
and ``sparse_stats``), and exits 0 after a completed run (the scores are a measurement, not a
pass/fail), 2 on bad arguments.

pytest: the CLI's argument errors, the engine options reaching the engine's ``Config``, and
small end-to-end CLI runs (niah_single_numbers, one ~1000-token prompt, offloaded KV, CPU; FULL,
and QUEST choosing pages from the host tier); the generator's own tests are in test_ruler_tasks.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import pytest

from tools import ruler
from tools.eval_engine import add_engine_arguments, engine_fields, make_llm, resolve_model_dir
from tools.ruler.evaluation import RulerSettings, build_samples, run_ruler


# ---- command line ------------------------------------------------------------------------
def _parse_tasks(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return list(ruler.TASKS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("must be 'all' or a comma-separated list of tasks")
    try:
        return list(dict.fromkeys(ruler.resolve_task(t) for t in names))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tests/test_ruler.py",
        description="RULER-style long-context evaluation of nanovllm: synthetic tasks with "
                    "prompts of exactly --input-len tokens, scored by RULER's metrics.")
    p.add_argument("--model", default=None,
                   help="HF model directory (default: SmolLM2-135M-Instruct via nanovllm.fetch)")
    p.add_argument("--tasks", type=_parse_tasks, default=list(ruler.TASKS),
                   help=f"'all' (default) or a comma-separated subset of {','.join(ruler.TASKS)}; "
                        f"RULER's names are accepted too and reported as ours: "
                        f"{', '.join(f'{a}={t}' for a, t in ruler.TASK_ALIASES.items())}")
    p.add_argument("--num-samples", type=int, default=5, help="samples per task (default 5)")
    p.add_argument("--input-len", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="answer budget for every task (default: RULER's per task: niah 128, vt 30, "
                        "cwe 120, fwe 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")
    add_engine_arguments(
        p, num_cpu_blocks_help="offload host KV blocks (default: what --max-num-seqs sequences need)",
        before_device=lambda p: p.add_argument("--max-num-seqs", type=int, default=1,
                                               help="sequences run together (default 1)"))
    p.add_argument("--json-output", default=None, metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = RulerSettings(
        tasks=args.tasks, num_samples=args.num_samples, input_len=args.input_len,
        max_new_tokens=args.max_new_tokens, seed=args.seed, max_num_seqs=args.max_num_seqs,
        **engine_fields(args))
    try:
        settings.validate()
    except ValueError as err:
        parser.error(str(err))

    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(parser, args.model, settings.max_model_len)
    t0 = time.perf_counter()
    try:
        samples = build_samples(AutoTokenizer.from_pretrained(model_dir), settings)
    except ValueError as err:
        parser.error(str(err))
    build_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        llm = make_llm(model_dir, settings)
    except ValueError as err:
        parser.error(str(err))
    load_s = time.perf_counter() - t0
    try:
        report = run_ruler(llm, settings, samples, log=lambda line: print(line, flush=True))
    finally:
        llm.shutdown()
    print()
    print(report.summary())
    print(f"\nsamples built in {build_s:.2f} s, engine loaded in {load_s:.2f} s")
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump({**report.to_json(), "build_seconds": build_s, "engine_load_seconds": load_s},
                      f, indent=2)
            f.write("\n")
    return 0


# ---- pytest (the generator's own tests: test_ruler_tasks.py) ---------------------------
def test_cli_argument_errors(capsys):
    cases = [
        (["--tasks", "vt,nope"], "unknown task 'nope'"),
        (["--num-samples", "0"], "num-samples must be an integer >= 1"),
        (["--input-len", "0"], "input-len must be an integer >= 1"),
        (["--enable-offload", "--num-ring-slots", "1"], "num-ring-slots must be >= 2"),
        (["--enable-offload", "--block-size", "1000"], "block-size must be a positive multiple of 256"),
        (["--block-size", "1000"], "block-size must be a positive multiple of 256"),
        (["--enable-offload", "--sparse-policy", "NOPE"], "sparse-policy must be one of"),
        (["--sparse-threshold", "-0.5"], "sparse-threshold must be in [0, 1]"),
        (["--sparse-page-size", "128"], "sparse-page-size must be one of [16, 32, 64]"),
        (["--sparse-policy", "QUEST", "--sparse-token-budget", "-5"], "sparse-token-budget must be an integer >= 1"),
        (["--sparse-group-score", "MAX"], "sparse-group-score must be one of ['max', 'sum']"),
        (["--sparse-dense-layers", "-2"], "sparse-dense-layers must be an integer >= 0"),
        (["--sparse-topk-blocks", "2", "--sparse-token-budget", "4096"], "give --sparse-token-budget only"),
        (["--input-len", "9000", "--tasks", "vt"], "exceeds the model's max_position_embeddings=8192"),
        (["--input-len", "100", "--tasks", "cwe"], "input_len=100 is too small for task 'cwe'"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize("offload", [False, True])
def test_block_size_reaches_the_engine_with_and_without_the_host_tier(offload):
    """QUEST chooses pages in both tiers, so --block-size must size the KV blocks without the host
    tier too (session 7's QUEST rows without it ran the engine's 256-token default)."""
    kw = RulerSettings(tasks=["vt"], enable_offload=offload, block_size=512, sparse_policy="QUEST").engine_kwargs()
    assert kw["kvcache_block_size"] == 512
    assert kw.get("enable_cpu_offload", False) is offload


def test_sparse_options_reach_the_engine():
    """Every sparse option of the CLI becomes the engine's own (its ``Config`` accepts them), with
    the engine's defaults, and the deprecated --sparse-topk-blocks is left to the engine, which
    turns it into the token budget."""
    import dataclasses
    import warnings

    from nanovllm.config import Config, check_engine_args
    from nanovllm.fetch import fetch_model

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    ours = {f.name: f.default for f in dataclasses.fields(RulerSettings)}
    for name in ("sparse_policy", "sparse_page_size", "sparse_token_budget", "sparse_sink_tokens",
                 "sparse_recent_tokens", "sparse_dense_layers", "sparse_group_score", "sparse_radius_weight",
                 "sparse_layer_budget_weights", "sparse_topk_blocks", "sparse_threshold", "sparse_stride"):
        assert ours[name] == defaults[name], name

    model = fetch_model()
    args = build_parser().parse_args(["--tasks", "vt", "--sparse-policy", "streaming", "--sparse-page-size", "32",
                                      "--sparse-sink-tokens", "64", "--sparse-recent-tokens", "512",
                                      "--sparse-dense-layers", "2", "--enable-offload", "--block-size", "512",
                                      "--num-reuse-cache-blocks", "3", "--device", "cpu"])
    settings = RulerSettings(tasks=args.tasks, **engine_fields(args))
    settings.validate()
    kw = settings.engine_kwargs()
    check_engine_args(kw)
    cfg = Config(model, **kw)
    assert (cfg.sparse_policy, cfg.sparse_page_size, cfg.sparse_sink_tokens, cfg.sparse_recent_tokens,
            cfg.sparse_dense_layers, cfg.num_reuse_cache_blocks) == ("STREAMING", 32, 64, 512, 2, 3)
    settings = RulerSettings(tasks=["vt"], sparse_policy="QUEST", sparse_group_score="sum", sparse_token_budget=300,
                             device="cpu")
    cfg = Config(model, **settings.engine_kwargs())
    assert (cfg.sparse_group_score, cfg.sparse_token_budget) == ("sum", 300)
    settings = RulerSettings(tasks=["vt"], sparse_policy="QUEST", sparse_topk_blocks=3, device="cpu")
    settings.validate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config(model, **settings.engine_kwargs())
    assert cfg.sparse_token_budget == 3 * 1024 and any("sparse_topk_blocks" in str(w.message) for w in caught)
    layers = cfg.hf_config.num_hidden_layers
    weights = ",".join(["1"] * (layers - 1) + ["2.5"])
    args = build_parser().parse_args(["--tasks", "vt", "--sparse-policy", "quest", "--device", "cpu",
                                      "--sparse-layer-budget-weights", weights])
    cfg = Config(model, **RulerSettings(tasks=args.tasks, **engine_fields(args)).engine_kwargs())
    assert cfg.sparse_layer_budget_weights == (1.0,) * (layers - 1) + (2.5,)


@pytest.mark.parametrize("sparse", [[], ["--block-size", "256", "--sparse-policy", "QUEST", "--sparse-token-budget",
                                            "64", "--sparse-recent-tokens", "64"]], ids=["full", "quest"])
def test_cli_end_to_end_small(tmp_path, capsys, sparse):
    """One ~1000-token niah_single_numbers prompt through the offloaded engine on CPU: the run
    completes, prints the table and scores in [0, 1] (the model's accuracy is not asserted). FULL
    on 1024-token blocks; QUEST on 256-token blocks choosing 4 of the ~58 candidate pages per KV
    head besides its 6 always-read ones (sink, 4 recent, the page written), most from the host."""
    out = tmp_path / "ruler.json"
    code = main(["--tasks", "niah_single", "--num-samples", "1", "--input-len", "1000",
                 "--max-new-tokens", "24", "--enable-offload", "--block-size", "1024",
                 "--num-ring-slots", "2", "--sparse-policy", "FULL", "--device", "cpu",
                 "--dtype", "float32", "--enforce-eager", "--json-output", str(out), *sparse])
    assert code == 0
    printed = capsys.readouterr().out
    assert re.search(r"^task\s+samples\s+mean score", printed, re.M), printed
    assert re.search(r"^niah_single_numbers\s+1\s+[01]\.\d{3}", printed, re.M), printed
    assert "overall (task mean)" in printed
    data = json.loads(out.read_text())
    (task,) = data["tasks"]
    assert task["task"] == "niah_single_numbers" and task["num_samples"] == 1
    (output,), (answers,) = task["outputs"], task["answers"]
    assert task["scores"] == [ruler.score("niah_single_numbers", output, answers)]  # scored from the output
    assert task["mean_score"] == data["overall_mean_score"] == task["scores"][0]
    assert data["offload"]["num_ring_slots"] == 2 and data["input_len"] == 1000
    assert 1 <= task["generated_tokens"][0] <= 24
    stats = data["sparse_stats"]
    assert stats["prefill"]["density"] == 1.0
    if not sparse:
        assert stats["policy"] == "FULL" and stats["decode"]["density"] == 1.0
        return
    decode = stats["decode"]
    assert stats["policy"] == "QUEST" and data["sparse_options"]["sparse_token_budget"] == 64
    assert "QUEST (page_size=16" in printed, printed
    assert 0.0 < decode["density"] < 0.2 and decode["read_tokens"] < decode["context_tokens"], decode
    assert 0.0 < decode["comm_density"] < 1.0 and decode["loaded_host_bytes"] > 0, decode


if __name__ == "__main__":
    sys.exit(main())
