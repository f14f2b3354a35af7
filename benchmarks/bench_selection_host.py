"""Host time of a choosing policy's decode step, with and without the reuse cache (issue 14).
Prints one JSON document.

With a policy that chooses decode pages per KV head (QUEST, STREAMING) the decode step runs
eagerly and the host never waits for the device's picks; what it does per step is:

- ``build``: :meth:`DecodeSelection.build`, once per step: a pass over the sequences' block tables
  (which sequences select, their fixed pages, the ring loads, the groups of sequences whose host
  reads fit the staging pages), the tables' uploads and the device ops that turn them into every
  page's place in either tier and the candidates' metadata pages;
- ``layers``: per layer, launching the policy's choice (``--score``: QUEST's bounds, scores and
  top-k; else random picks of the same shape, drawn outside the timed part), then for each group
  :meth:`DecodeSelection.layer_reads` (the reads' page tables and the gather list, with
  :meth:`ReuseCache.place` when there is a reuse cache) and the statistics' host count
  (:meth:`DecodeSelection.read_tokens`).

The attention kernels and the gathers themselves are not launched. This times both parts alone at
the shape of the 130K benchmark by default (Llama-3.1-8B: 32 layers, 32 query and 8 KV heads,
head_dim 128; ``--seqs`` sequences of 32 4,096-token blocks, the first and the last in the GPU
tier, the rest on the host; pages of 16 tokens, the engine's default budget per KV head),
``--steps`` steps after ``--warmup``, with the reuse cache (the engine's default size, or
``--reuse-rows`` rows per layer) and without it, in alternating rounds (``--rounds``), the best
round of each reported. On CUDA the times are the host's (launches; the device runs behind),
``synced_ms`` the step with the device's work, and ``host_syncs`` counts the device syncs the
timed part made (torch's sync debug mode; the design has none). On CPU every op runs on the host:
the times include the ops' work.

    python -m benchmarks.bench_selection_host                  # CUDA if available
    python -m benchmarks.bench_selection_host --device cpu --layers 4 --blocks 8 --steps 5
"""
import argparse
import json
import time
import warnings
from types import SimpleNamespace

import torch

from nanovllm.config import FIELD_DEFAULTS
from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.reuse import ReuseCache, reuse_cache_rows
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.kvcache.tier_rows import TierRows, staging_rows
from nanovllm.sparse import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET, policy_class


def _config(args, reuse_rows: int) -> SimpleNamespace:
    """The engine options that size the reuse cache and the staging rows: ``Config``'s defaults
    (so that every option a policy reads is there) with this benchmark's values."""
    return SimpleNamespace(**{**FIELD_DEFAULTS, **dict(
        sparse_policy=args.policy, sparse_page_size=args.page_size, sparse_token_budget=args.budget,
        sparse_sink_tokens=args.sink_tokens, sparse_recent_tokens=args.recent_tokens,
        sparse_dense_layers=args.dense_layers, sparse_group_score=args.group_score,
        sparse_radius_weight=args.radius_weight, kvcache_block_size=args.block_size, max_num_seqs=args.seqs,
        num_reuse_cache_blocks=reuse_rows, max_model_len=1 << 30)})


def _tables(seqs: int, blocks: int, block_size: int) -> list[tuple[list[int], list[int], int]]:
    """Per sequence: its first and last block in the GPU tier, the others on the host; the last
    block partly written."""
    tables = []
    for s in range(seqs):
        host = list(range(s * (blocks - 2), (s + 1) * (blocks - 2)))
        tables.append(([2 * s] + [NO_BLOCK] * (blocks - 2) + [2 * s + 1], [NO_BLOCK] + host + [NO_BLOCK],
                       blocks * block_size - 100))
    return tables


def time_steps(args, reuse_rows: int, device: torch.device) -> dict:
    """Mean ms per step of ``build`` and of the layers' work (module doc) over ``args.steps``
    steps after ``args.warmup``; ``reuse_rows`` 0: no reuse cache."""
    cuda = device.type == "cuda"
    config = _config(args, reuse_rows)
    cls = policy_class(args.policy)
    policy = cls.from_config(config, args.head_dim ** -0.5)
    gpu_blocks, host_blocks = 2 * args.seqs, args.seqs * (args.blocks - 2)
    ppb = args.block_size // args.page_size
    rows = reuse_cache_rows(config) if reuse_rows else 0
    layout = TierRows(args.layers, gpu_blocks + rows, staging_rows(config))
    reuse = ReuseCache(args.layers, args.kv_heads, rows, gpu_blocks, layout.layer_rows, ppb, device) if rows else None
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.score:
        policy.allocate(args.layers, args.block_size, args.kv_heads, args.head_dim, dtype, device, gpu_blocks,
                        host_blocks)
        if getattr(policy, "kmin", None) is not None:
            policy.kmin.normal_()
            policy.kmax.copy_(policy.kmin + 1)
    q = torch.randn(args.seqs, args.q_heads, args.head_dim, dtype=dtype, device=device)
    tables = _tables(args.seqs, args.blocks, args.block_size)
    generator = torch.Generator(device=device).manual_seed(0)
    selection = DecodeSelection.build(policy, tables, layout, gpu_blocks, args.block_size, args.kv_heads, device)
    if selection is None:
        raise RuntimeError("the policy selects for no sequence at this shape: give more --blocks")
    num_cand = selection.candidates.pages.shape[1]  # the same every step: the tables do not change
    k = min(policy.budget_pages, num_cand)
    build = layers = synced = 0.0
    syncs = 0
    for step in range(args.warmup + args.steps):
        if not args.score:  # random distinct picks per (sequence, KV head), drawn outside the timed part
            picks = [torch.rand(args.seqs, args.kv_heads, num_cand, generator=generator, device=device).topk(k, dim=2)
                     .indices for _ in range(args.layers)]
        if cuda:
            torch.cuda.synchronize()
        timed = step >= args.warmup
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda and timed:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            if reuse is not None:
                reuse.begin_step()
            selection = DecodeSelection.build(policy, tables, layout, gpu_blocks, args.block_size, args.kv_heads,
                                              device)
            t1 = time.perf_counter()
            for layer in range(args.layers):
                chosen = (policy.select_decode_pages(layer, selection.queries(q), selection.candidates) if args.score
                          else picks[layer])
                for group in range(len(selection.groups)):
                    selection.layer_reads(layer, chosen, group, reuse)
                selection.read_tokens(layer, chosen.shape[2])
            t2 = time.perf_counter()
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            t3 = time.perf_counter()
        if timed:
            build, layers, synced = build + t1 - t0, layers + t2 - t1, synced + t3 - t0
            syncs += sum("synchroniz" in str(w.message) for w in caught)
    out = {"build_ms": round(build / args.steps * 1e3, 3), "layers_ms": round(layers / args.steps * 1e3, 3),
           "per_layer_us": round(layers / args.steps / args.layers * 1e6, 1), "reuse_rows": rows,
           "staging_rows": layout.staging_rows, "groups": len(selection.groups)}
    if cuda:
        out.update(synced_ms=round(synced / args.steps * 1e3, 3), host_syncs=syncs)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="QUEST", type=str.upper, choices=("QUEST", "STREAMING"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", type=int, default=1, help="sequences of the batch")
    p.add_argument("--blocks", type=int, default=32, help="blocks of each sequence (>= 3)")
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16, choices=(16, 32, 64))
    p.add_argument("--budget", type=int, default=DEFAULT_TOKEN_BUDGET, help="sparse_token_budget (QUEST)")
    p.add_argument("--sink-tokens", type=int, default=16)
    p.add_argument("--recent-tokens", type=int, default=256)
    p.add_argument("--dense-layers", type=int, default=0)
    p.add_argument("--group-score", default=DEFAULT_GROUP_SCORE, choices=("max", "sum"))
    p.add_argument("--radius-weight", type=float, default=DEFAULT_RADIUS_WEIGHT, help="sparse_radius_weight (QUEST)")
    p.add_argument("--score", action="store_true", help="launch the policy's scoring (default: random picks)")
    p.add_argument("--reuse-rows", type=int, default=-1, help="reuse-cache rows per layer (-1: the engine's default)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name in ("layers", "q_heads", "kv_heads", "head_dim", "seqs", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.reuse_rows < -1 or args.blocks < 3:
        p.error(f"--warmup must be >= 0, --reuse-rows >= -1 and --blocks >= 3, got {args.warmup}, {args.reuse_rows}, "
                f"{args.blocks}")
    if args.q_heads % args.kv_heads or args.block_size % args.page_size:
        p.error("--kv-heads must divide --q-heads and --page-size divide --block-size")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    runs = {"no_reuse": [], "reuse": []}
    for _ in range(args.rounds):
        for name, rows in (("no_reuse", 0), ("reuse", args.reuse_rows)):
            runs[name].append(time_steps(args, rows, device))
    best = {name: min(r, key=lambda x: x["build_ms"] + x["layers_ms"]) for name, r in runs.items()}
    shape = {k: getattr(args, k) for k in ("policy", "layers", "q_heads", "kv_heads", "head_dim", "seqs", "blocks",
                                           "block_size", "page_size", "budget", "sink_tokens", "recent_tokens",
                                           "dense_layers", "group_score", "radius_weight", "score", "steps", "device")}
    total = {name: b["build_ms"] + b["layers_ms"] for name, b in best.items()}
    print(json.dumps({**shape, **best, "reuse_extra_ms": round(total["reuse"] - total["no_reuse"], 3)}))


if __name__ == "__main__":
    main()
