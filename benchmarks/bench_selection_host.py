"""Host time of a QUEST decode step's selection bookkeeping, with and without the reuse cache
(issue 14). Prints one JSON document.

Between two decode steps the host plans the next one (``DecodeSelection.build``: the step's
tables, the reuse cache's lookup and victims) and records the last one from its picks
(``DecodeSelection.replay``: where each miss landed, the reuse cache's entries, the statistics);
the GPU waits for both. This times them alone, on CPU tensors, at the shape of the 130K benchmark
by default (one sequence, 32 layers, 32 blocks of which the first and the last are in the GPU tier,
top-k 4), with random picks per layer: ``--steps`` steps after ``--warmup``, with the reuse cache
(``--reuse-rows`` rows per layer) and without it, in alternating rounds (``--rounds``), the
best round of each reported.

    python -m benchmarks.bench_selection_host
"""
import argparse
import json
import time

import torch

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.reuse import ReuseCache
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.kvcache.tier_rows import TierRows
from nanovllm.sparse import SparseStats
from nanovllm.sparse.quest import QuestPolicy

GPU_BLOCKS = 4
BLOCK_SIZE = 4096


class _HostTierStandIn:
    """What ``replay`` tells the host tier (its gathered-block count), discarded."""

    def note_gathered(self, num_blocks: int) -> None:
        pass


def time_steps(layers: int, blocks: int, topk: int, reuse_rows: int, steps: int, warmup: int) -> dict:
    """Mean ms per step of ``build`` and of ``replay`` over ``steps`` steps after ``warmup``."""
    layout = TierRows(layers, GPU_BLOCKS + reuse_rows, topk)
    policy = QuestPolicy(0.1, topk_blocks=topk, threshold_blocks=4)
    reuse = ReuseCache(layers, reuse_rows, GPU_BLOCKS) if reuse_rows else None
    stats, host_tier = SparseStats(), _HostTierStandIn()
    gpu_table = [0] + [NO_BLOCK] * (blocks - 2) + [1]
    host_table = [NO_BLOCK] + list(range(blocks - 2)) + [NO_BLOCK]
    generator = torch.Generator().manual_seed(0)
    build = replay = 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        selection = DecodeSelection.build(policy, [(gpu_table, host_table, blocks * BLOCK_SIZE - 100)], layout,
                                          GPU_BLOCKS, BLOCK_SIZE, torch.device("cpu"), reuse)
        t1 = time.perf_counter()
        picks = [torch.randperm(blocks - 3, generator=generator)[:topk][None] + 1 for _ in range(layers)]
        t2 = time.perf_counter()
        selection.replay(picks, reuse, stats, host_tier)
        t3 = time.perf_counter()
        if step >= warmup:
            build, replay = build + t1 - t0, replay + t3 - t2
    return {"build_ms": round(build / steps * 1e3, 3), "replay_ms": round(replay / steps * 1e3, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=32, help="blocks of the sequence (>= topk + 4)")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--reuse-rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for name in ("layers", "topk", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.reuse_rows < 0:
        p.error(f"--warmup and --reuse-rows must be >= 0, got {args.warmup} and {args.reuse_rows}")
    if args.blocks < args.topk + 4:
        p.error(f"--blocks must be >= --topk + 4 = {args.topk + 4}, got {args.blocks}")
    torch.set_num_threads(1)
    runs = {"no_reuse": [], "reuse": []}
    for _ in range(args.rounds):
        for name, rows in (("no_reuse", 0), ("reuse", args.reuse_rows)):
            runs[name].append(time_steps(args.layers, args.blocks, args.topk, rows, args.steps, args.warmup))
    best = {name: min(r, key=lambda x: x["build_ms"] + x["replay_ms"]) for name, r in runs.items()}
    print(json.dumps({"layers": args.layers, "blocks": args.blocks, "topk": args.topk, "reuse_rows": args.reuse_rows,
                      "steps": args.steps, **best,
                      "reuse_extra_ms": round(sum(best["reuse"].values()) - sum(best["no_reuse"].values()), 3)}))


if __name__ == "__main__":
    main()
