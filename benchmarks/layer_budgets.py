"""Fit ``sparse_layer_budget_weights`` for a model: the share of QUEST's decode budget each layer
gets so that the same total reads keep the most attention mass (CPU, transformers, float32).

Method: the samples, teacher-forced answers, always-read pages and recall of
``benchmarks/page_recall.py`` (recall of a query head: its attention mass in the pages a decode
step reads), with the engine's QUEST at its default estimate making the picks. Per sample and
layer, the mean recall (over decode positions and query heads) at every budget of ``--budgets``
(the grid); a dynamic program then picks one grid budget per layer that maximises the summed mean
recall over the fitting samples, the budgets adding up to ``num_layers x --mean-budget``. The
weights are those budgets over ``--mean-budget`` (mean 1): ``LLM(..., sparse_policy="QUEST",
sparse_layer_budget_weights=weights)`` scales them to its own ``sparse_token_budget`` (``weights =
json.load(open(report))["weights"]``). They suit the model they were fitted on (its layer count), at
the page size and recent window of the fit (16 tokens; ``--recent-tokens``); MOMENTS and ORACLE
take them too, but the fit scores pages as QUEST does.

With ``--cross-validate`` the samples of each task are split by index into two halves; the budgets
are fitted on one half and scored on the other against ``--mean-budget`` at every layer (the paired
difference of the mean recall ± its standard error over the held-out samples), both ways round.
``--score WEIGHTS_JSON`` scores weights fitted elsewhere (another length, other samples: a report
of this tool) on these samples the same way: each layer's budget ``--mean-budget x weight`` must be
in the grid.

    python -m nanovllm.fetch qwen2.5-coder-0.5b        # the model, converted once (default --model)
    python -m benchmarks.layer_budgets --num-samples 2 --cross-validate --out layer_budgets.json
    python -m benchmarks.layer_budgets --length 16384 --num-samples 1 --mean-budget 2944 \
        --budgets 736,1472,2208,2944,4416,5888,8832 --score layer_budgets.json
"""
from __future__ import annotations

import json
import math
import sys
import time

import torch

from benchmarks.page_recall import (Capture, layer_recall, load_model, print_report, study_parser,
                                    teacher_forced)
from nanovllm.sparse.quest import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT

ESTIMATOR = {"QUEST": ("quest", DEFAULT_RADIUS_WEIGHT, DEFAULT_GROUP_SCORE, None)}
"""The engine's QUEST at its default estimate (``page_recall.layer_recall``'s estimator format)."""


def layer_curves(model, tokenizer, capture: Capture, sample: dict, grid: list[int], recent: int) -> torch.Tensor:
    """One sample's mean recall per layer and grid budget: float32 ``[num_layers, len(grid)]``."""
    ids, _, capture.positions = teacher_forced(tokenizer, sample)
    with torch.inference_mode():
        model.model(input_ids=ids, use_cache=False)
        rows = []
        for layer in sorted(capture.k):
            recall = layer_recall(capture.q[layer], capture.k[layer], capture.positions, grid, ESTIMATOR,
                                  recent=recent)
            rows.append([recall[("QUEST", b)].mean().item() for b in grid])
    return torch.tensor(rows)


def allocate(curve: torch.Tensor, grid: list[int], total: int) -> list[int]:
    """One budget of ``grid`` per layer, adding up to ``total``, that maximises the summed
    ``curve[layer, grid index]`` (a knapsack over the layers, in units of the grid's and the
    total's greatest common divisor).

    Raises:
        ValueError: no choice of grid budgets adds up to ``total``.
    """
    unit = math.gcd(*grid, total)
    units = [b // unit for b in grid]
    best = {0: (0.0, [])}  # units used so far -> (summed recall, budgets chosen)
    for row in curve.tolist():
        reach = {}
        for used, (value, chosen) in best.items():
            for budget, u, gain in zip(grid, units, row):
                key = used + u
                if key <= total // unit and (key not in reach or value + gain > reach[key][0]):
                    reach[key] = (value + gain, chosen + [budget])
        best = reach
    if total // unit not in best:
        raise ValueError(f"no budgets of {grid} for {curve.shape[0]} layers add up to {total}")
    return best[total // unit][1]


def held_out(curves: list[torch.Tensor], budgets: list[int], grid: list[int], budget: int) -> dict:
    """The mean recall of ``budgets`` against ``budget`` at every layer over ``curves`` (per
    sample ``[num_layers, len(grid)]``), and their paired difference ± its standard error."""
    stacked = torch.stack(curves)  # [n, L, G]
    layers = torch.arange(stacked.shape[1])
    fitted = stacked[:, layers, torch.tensor([grid.index(b) for b in budgets])].mean(1)
    uniform = stacked[:, :, grid.index(budget)].mean(1)
    diff = fitted - uniform
    se = (diff.std() / len(diff) ** 0.5).item() if len(diff) > 1 else float("nan")
    return {"uniform": uniform.mean().item(), "fitted": fitted.mean().item(), "difference": diff.mean().item(),
            "difference_se": se, "budgets": budgets}


def main(argv=None) -> None:
    """Parse arguments, fit the weights, print the JSON."""
    p = study_parser(__doc__.split("\n\n")[0], 2, "128,256,384,512,768,1024,1536")
    p.add_argument("--mean-budget", type=int, default=512, help="tokens per KV head a layer reads on average")
    p.add_argument("--recent-tokens", type=int, default=256, help="the always-read recent window")
    p.add_argument("--cross-validate", action="store_true", help="fit on half the samples, score on the other")
    p.add_argument("--score", metavar="JSON", help="also score the weights of this report against the uniform budget")
    args = p.parse_args(argv)
    from tools import ruler

    grid = sorted(int(b) for b in args.budgets.split(","))
    if args.mean_budget not in grid:
        raise SystemExit(f"--mean-budget {args.mean_budget} must be one of --budgets {grid}")
    if args.cross_validate and args.num_samples < 2:
        raise SystemExit(f"--cross-validate needs --num-samples >= 2, got {args.num_samples}")
    scored = None
    if args.score:
        with open(args.score) as f:
            scored = [round(args.mean_budget * w) for w in json.load(f)["weights"]]
        if not set(scored) <= set(grid):
            raise SystemExit(f"--score's budgets {sorted(set(scored))} (--mean-budget x its weights) must be in --budgets {grid}")
    capture = Capture()
    model, tokenizer = load_model(args.model, capture)
    if scored is not None and len(scored) != model.config.num_hidden_layers:
        raise SystemExit(f"--score {args.score} has {len(scored)} weights; the model has "
                         f"{model.config.num_hidden_layers} layers")
    input_len = args.length - max(ruler.MAX_NEW_TOKENS.values())  # as benchmarks/ruler_sweep.py
    curves, halves, start = [], ([], []), time.time()
    for task in args.tasks.split(","):
        for i, sample in enumerate(ruler.generate_samples(tokenizer, task, args.num_samples, input_len,
                                                          seed=args.seed)):
            curves.append(layer_curves(model, tokenizer, capture, sample, grid, args.recent_tokens))
            halves[i % 2].append(curves[-1])
            print(f"{task} {i}: {time.time() - start:.0f} s", file=sys.stderr)
    total = args.mean_budget * curves[0].shape[0]
    budgets = allocate(torch.stack(curves).mean(0), grid, total)
    report = {"model": args.model, "length": args.length, "tasks": args.tasks.split(","),
              "num_samples": args.num_samples, "seed": args.seed, "mean_budget": args.mean_budget, "grid": grid,
              "recent_tokens": args.recent_tokens, "budgets": budgets,
              "weights": [b / args.mean_budget for b in budgets],
              "seconds": round(time.time() - start, 1)}
    if args.cross_validate:
        report["cross_validation"] = [
            held_out(test, allocate(torch.stack(fit).mean(0), grid, total), grid, args.mean_budget)
            for fit, test in (halves, halves[::-1])]
    if scored is not None:
        report["scored"] = {"weights_from": args.score, **held_out(curves, scored, grid, args.mean_budget)}
    print_report(report, args.out)


if __name__ == "__main__":
    main()
