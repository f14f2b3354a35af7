"""Could a layer's decode pages be chosen a layer ahead? (CPU, transformers, float32)

Over the host tier, a layer's page gather can start only once that layer's query exists (QUEST
scores pages from it), so the gather cannot overlap the layer's own compute. InfiniGen (Lee et
al., OSDI 2024) speculates layer ``j``'s query from an earlier layer's input: the residual stream
entering layer ``j - a`` (lookahead ``a``) through layer ``j``'s input RMSNorm, q projection (with
its bias) and RoPE at the decode position. Picks made from that query could be gathered while
layers ``j - a .. j - 1`` compute, leaving only the real picks it missed to be gathered late.

Method: as ``benchmarks/page_recall.py`` (its RULER samples, teacher forcing and capture of the
post-RoPE queries and keys), plus the residual stream entering every layer at the decode
positions (the last prompt token and the answer tokens, consecutive decode steps). Per layer
``j >= a``, KV head and position, the engine's QUEST (``page_recall.choose`` with the engine's
default radius weight and GQA combination, pages of 16, 16 sink and 256 recent tokens always
read) picks from the real query and from the speculative one, and (means over layers, positions
and KV heads, as fractions of the real picks):

- ``overlap``: real picks the speculative ones contain;
- ``consecutive``: real picks the previous step's real picks of the layer contain (what the
  reuse cache alone can hit);
- ``cover``: real picks contained in the speculative picks or the previous step's: fetched before
  the layer runs when the reuse cache holds the previous step's picks and the speculation is
  gathered ahead (the rest are gathered late);
- ``prefetch``: speculative picks outside the previous step's picks: the pages a speculative
  gather moves, against ``1 - consecutive`` moved today;
- ``mass_real`` / ``mass_spec``: attention mass in the always-read pages plus the real / the
  speculative picks (mean over query heads).

Also ``max_query_error``: the largest difference between the query recomputed from a layer's own
input and the captured one (the pipeline's check; 0 up to float32 rounding).

    python -m nanovllm.fetch qwen2.5-coder-0.5b        # the model, converted once (default --model)
    python -m benchmarks.speculative_picks --out speculative_picks_8k.json
"""
from __future__ import annotations

import sys
import time

import torch

from benchmarks.page_recall import (Capture, choose, load_model, page_mass, print_report, read_pages, study_parser,
                                    teacher_forced)
from nanovllm.sparse import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT

PAGE, SINK, RECENT = 16, 16, 256
"""The engine's default pages and always-read tokens (``nanovllm/sparse/quest.py``)."""
METRICS = ("overlap", "consecutive", "cover", "prefetch", "mass_real", "mass_spec")


def picked(q: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, first: int, num_total: int,
           budget: int, page: int = PAGE) -> torch.Tensor:
    """QUEST's picks from ``q`` (the engine's policy), bool ``[S, Hkv, NP]``."""
    picks = choose("quest", DEFAULT_RADIUS_WEIGHT, DEFAULT_GROUP_SCORE, q, keys, candidates, first, page, budget)
    mask = torch.zeros(q.shape[0], keys.shape[1], num_total + 1, dtype=torch.bool)
    mask.scatter_(2, torch.where(picks >= 0, picks + first, num_total), True)
    return mask[..., :num_total]


def layer_metrics(q: torch.Tensor, q_spec: torch.Tensor, keys: torch.Tensor, positions: list[int], budget: int,
                  page: int = PAGE, sink: int = SINK, recent: int = RECENT) -> dict[str, torch.Tensor]:
    """The module doc's metrics for one layer.

    Args:
        q, q_spec: float32 ``[S, Hq, D]``: the real and the speculative post-RoPE queries at
            ``positions`` (consecutive decode steps, increasing).
        keys: float32 ``[T, Hkv, D]``, post-RoPE.
        budget: tokens QUEST picks per KV head (``budget / page`` pages).

    Returns:
        ``{metric: float32 tensor}``: ``overlap`` ``[S, Hkv]``, ``consecutive`` / ``cover`` /
        ``prefetch`` ``[S - 1, Hkv]`` (positions 1..), ``mass_real`` / ``mass_spec`` ``[S, Hq]``.
    """
    candidates, fixed, first, num_total = read_pages(positions, keys.shape[0], page, sink, recent)
    real = picked(q, keys, candidates, first, num_total, budget, page)
    spec = picked(q_spec, keys, candidates, first, num_total, budget, page)
    count = real.sum(-1).clamp(min=1).float()
    mass = page_mass(q, keys, positions, page)
    group = q.shape[1] // keys.shape[1]

    def kept(pages):
        return (mass * (fixed[:, None] | pages).repeat_interleave(group, dim=1)).sum(-1)

    before = real[:-1]  # the previous step's real picks, held by the reuse cache
    return {"overlap": (spec & real).sum(-1) / count,
            "consecutive": (before & real[1:]).sum(-1) / count[1:],
            "cover": ((spec[1:] | before) & real[1:]).sum(-1) / count[1:],
            "prefetch": (spec[1:] & ~before).sum(-1) / count[1:],
            "mass_real": kept(real), "mass_spec": kept(spec)}


def speculative_query(model, layer: int, stream: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Layer ``layer``'s query from a residual stream ``[S, hidden]`` (float32 ``[S, Hq, D]``):
    RoPE(q_proj(input_layernorm(stream))), with the transformers model's own modules (a
    Llama-layout model: Qwen2, Llama; its half-split RoPE)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    block = model.model.layers[layer]
    x = block.input_layernorm(stream[None])
    q = block.self_attn.q_proj(x).view(1, x.shape[1], -1, block.self_attn.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.tensor([positions]))
    return apply_rotary_pos_emb(q, q, cos, sin)[0][0].transpose(0, 1).float()


def study(model, tokenizer, capture: Capture, sample: dict, budgets: list[int], lookaheads: list[int]):
    """One sample: ``{(lookahead, budget, metric): [per layer tensors]}`` and the largest error of
    the query recomputed from each layer's own input."""
    ids, _, positions = teacher_forced(tokenizer, sample)
    capture.positions = positions
    streams: dict[int, torch.Tensor] = {}

    def keep_input(index):
        def hook(module, args, kwargs):
            streams[index] = (args[0] if args else kwargs["hidden_states"])[0, positions].float().clone()
        return hook

    layers = model.model.layers
    handles = [block.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, block in enumerate(layers)]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)
            error = max((speculative_query(model, j, streams[j], positions) - capture.q[j]).abs().max().item()
                        for j in range(len(layers)))
            out: dict[tuple, list] = {}
            for j in range(1, len(layers)):
                for a in (a for a in lookaheads if j >= a):
                    q_spec = speculative_query(model, j, streams[j - a], positions)
                    for budget in budgets:
                        for name, value in layer_metrics(capture.q[j], q_spec, capture.k[j], positions, budget).items():
                            out.setdefault((a, budget, name), []).append((j, value))
    finally:
        for handle in handles:
            handle.remove()
    return out, error


def summarize(runs: list[dict], budgets: list[int], lookaheads: list[int]) -> dict:
    """Means over samples, layers, positions and heads, and per layer (lowest and highest)."""
    report = {}
    for a in lookaheads:
        for budget in budgets:
            entry = {}
            for name in METRICS:
                by_layer: dict[int, list] = {}
                for run in runs:
                    for j, value in run.get((a, budget, name), []):
                        by_layer.setdefault(j, []).append(value.flatten())
                per_layer = {j: torch.cat(v).mean().item() for j, v in sorted(by_layer.items())}
                low, high = min(per_layer, key=per_layer.get), max(per_layer, key=per_layer.get)
                entry[name] = {"mean": torch.cat([torch.cat(v) for v in by_layer.values()]).mean().item(),
                               "lowest_layer": [low, per_layer[low]], "highest_layer": [high, per_layer[high]]}
            report[f"lookahead{a}_budget{budget}"] = entry
    return report


def main(argv=None) -> None:
    """Parse arguments, build the samples, run the study, print the JSON."""
    p = study_parser(__doc__.split("\n\n")[0], 1, "512,1024")
    p.add_argument("--lookaheads", default="1,2", help="layers ahead the query is speculated from")
    args = p.parse_args(argv)
    from tools import ruler

    budgets = [int(b) for b in args.budgets.split(",")]
    lookaheads = [int(a) for a in args.lookaheads.split(",")]
    capture = Capture()
    model, tokenizer = load_model(args.model, capture)
    input_len = args.length - max(ruler.MAX_NEW_TOKENS.values())  # as benchmarks/ruler_sweep.py
    runs, errors, start = [], [], time.time()
    for task in args.tasks.split(","):
        for i, sample in enumerate(ruler.generate_samples(tokenizer, task, args.num_samples, input_len,
                                                           seed=args.seed)):
            run, error = study(model, tokenizer, capture, sample, budgets, lookaheads)
            runs.append(run)
            errors.append(error)
            print(f"{task} {i}: {time.time() - start:.0f} s", file=sys.stderr)
    report = {"model": args.model, "length": args.length, "prompt_tokens": input_len, "tasks": args.tasks.split(","),
              "num_samples": args.num_samples, "seed": args.seed, "budgets": budgets, "lookaheads": lookaheads,
              "max_query_error": max(errors), "seconds": round(time.time() - start, 1),
              **summarize(runs, budgets, lookaheads)}
    print_report(report, args.out)


if __name__ == "__main__":
    main()
