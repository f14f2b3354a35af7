"""How much of the true attention mass each decode page selector keeps (CPU, transformers, float32).

Method: each RULER sample (tools/ruler, seed 0, prompts of ``length - 128`` tokens as
benchmarks/ruler_sweep.py builds them) is teacher-forced through the model followed by its gold
answer (the references joined by ", " after a space, at most 16 tokens), with a custom attention
function (transformers' AttentionInterface) that records every layer's post-RoPE queries and keys
and computes sdpa for the forward. The decode positions studied are the last prompt token and
every answer token. Per layer, KV head and position ``t`` (keys ``0..t``, as in decode):

- each query head's exact attention probabilities, softmax of ``q . k / sqrt(D)``;
- pages of 16 tokens; always read (nanovllm/sparse/choosing.py, kvcache/selection.py): the first
  page (16 sinks), the 16 pages (256 tokens) before the page holding ``t``, and that page; the
  candidates are every other page (all full);
- each estimator is the engine's policy (nanovllm/sparse: QUEST with radius weight ``w``, MOMENTS,
  ORACLE), its page metadata built from the keys by ``on_pages_full`` and its picks made by
  ``select_decode_pages`` (the GQA group combined by "max", or "sum"; ``budget / 16`` pages, chosen
  anew at each budget);
- recall of a query head = its attention mass in the always-read and selected pages.

Output (JSON on stdout, and --out): per estimator and budget the mean recall over samples,
positions, layers and query heads, the mean of the per-(KV head) minimum over its query heads,
both for the last prompt token and the answer positions, per task, and per layer at budget 512;
FIXED_ONLY (budget 0) is the always-read pages alone; the mean density (tokens read / context)
per budget; the teacher-forced answer-token accuracy.

    python -m nanovllm.fetch qwen2.5-coder-0.5b        # the model, converted once (default --model)
    python -m benchmarks.page_recall --num-samples 4 --out page_recall_8k.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from nanovllm.fetch import default_dest
from nanovllm.sparse import DecodeCandidates
from nanovllm.sparse.moments import MomentsPolicy
from nanovllm.sparse.oracle import OraclePolicy
from nanovllm.sparse.quest import QuestPolicy

TASKS = "niah_multiquery,niah_multivalue,niah_single_uuids,fwe,niah_multikey"
ESTIMATORS = {"ORACLE": ("oracle", None, "max", None), **{f"QUEST_w{w}": ("quest", w, "max", None) for w in
              (1.0, 0.75, 0.5, 0.25, 0.0)}, "MOMENTS": ("moments", None, "max", None),
              "ORACLE_sum": ("oracle", None, "sum", (512,)), "QUEST_w0.5_sum": ("quest", 0.5, "sum", (512,))}
"""name -> (kind, radius weight, group combine, budgets: None for every budget)."""
POLICIES = {"quest": QuestPolicy, "moments": MomentsPolicy, "oracle": OraclePolicy}
"""kind -> the engine's policy class, which scores and picks exactly as in decode."""
MAX_ANSWER_TOKENS = 16


def choose(kind: str, weight: float | None, combine: str, q: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor,
           first: int, page: int, budget: int) -> torch.Tensor:
    """The engine's policy of ``kind`` ("quest" with radius weight ``weight``, "moments", "oracle")
    choosing among ``pages``: its metadata built from ``keys``' full pages as one block
    (``on_pages_full``), its picks by ``select_decode_pages``.

    Args: q float32 ``[S, Hq, D]``; keys float32 ``[T, Hkv, D]``; pages int64 ``[S, C]`` candidate
    page ids (-1: none), candidate 0 being logical page ``first``; budget tokens per KV head.

    Returns: int64 ``[S, Hkv, k]`` candidate columns (in column order), -1 for none.
    """
    full = keys.shape[0] // page
    extra = {"radius_weight": weight} if "sparse_radius_weight" in POLICIES[kind].options else {}
    policy = POLICIES[kind](1.0 / math.sqrt(q.shape[-1]), page_size=page, budget_tokens=budget, group_score=combine,
                            **extra)
    policy.allocate(1, full * page, keys.shape[1], keys.shape[2], keys.dtype, keys.device, 1, 0)
    policy.on_pages_full(keys[None, None, :full * page], torch.zeros(1, dtype=torch.long))
    return policy.select_decode_pages(0, q, DecodeCandidates(list(range(q.shape[0])), pages, first, keys.shape[1]))


def read_pages(positions: list[int], num_keys: int, page: int, sink: int, recent: int):
    """The always-read pages and the candidates of each decode position ``t`` (keys ``0..t``): the
    first ``ceil(sink / page)`` pages, the ``ceil(recent / page)`` pages before the page holding
    ``t`` and that page are always read, every other page is a candidate. Returns ``(candidates
    int64 [S, C]`` page ids, -1: none; ``fixed`` bool ``[S, NP]``; the first candidate page; ``NP``
    the pages of ``num_keys`` keys)."""
    pos = torch.tensor(positions)
    num_total = math.ceil(num_keys / page)
    sink_pages, tail = math.ceil(sink / page), math.ceil(recent / page) + 1
    num_pages = (pos + page) // page  # ceil((t + 1) / page)
    ids = torch.arange(num_total)
    fixed = (ids < sink_pages) | ((ids >= (num_pages - tail)[:, None]) & (ids < num_pages[:, None]))  # [S, NP]
    count = (num_pages - sink_pages - tail).clamp(min=0)
    columns = torch.arange(int(count.max()))
    return torch.where(columns < count[:, None], columns + sink_pages, -1), fixed, sink_pages, num_total


def page_mass(q: torch.Tensor, keys: torch.Tensor, positions: list[int], page: int) -> torch.Tensor:
    """Each query head's exact attention probability mass per page, float32 ``[S, Hq, NP]``: softmax of
    ``q . k / sqrt(D)`` over keys ``0..t`` at each position ``t`` (q ``[S, Hq, D]``, keys ``[T, Hkv, D]``)."""
    group = q.shape[1] // keys.shape[1]
    num_total = math.ceil(keys.shape[0] / page)
    logits = torch.einsum("shd,thd->sht", q, keys.repeat_interleave(group, dim=1)) * (1.0 / math.sqrt(q.shape[2]))
    logits = logits.masked_fill(torch.arange(keys.shape[0]) > torch.tensor(positions)[:, None, None], float("-inf"))
    logits = F.pad(logits, (0, num_total * page - keys.shape[0]), value=float("-inf"))
    return torch.softmax(logits, dim=-1).view(*q.shape[:2], num_total, page).sum(-1)


def layer_recall(q: torch.Tensor, keys: torch.Tensor, positions: list[int], budgets: list[int],
                 estimators: dict = ESTIMATORS, page: int = 16, sink: int = 16, recent: int = 256) -> dict:
    """Recall of every (estimator, budget) for one layer.

    Args:
        q: float32 ``[S, Hq, D]``, post-RoPE queries at ``positions`` (length S, increasing).
        keys: float32 ``[T, Hkv, D]``, post-RoPE keys, ``T > max(positions)``.
        budgets: tokens picked per KV head (``ceil(b / page)`` pages).
        estimators: as :data:`ESTIMATORS` (an estimator's own budgets are those of ``budgets`` it names).

    Returns: ``{(name, budget): float32 [S, Hq] recall}`` (and ``("FIXED_ONLY", 0)``: the
    always-read pages alone) and ``{("density", budget): float32 [S]}``, tokens read over ``t + 1``.
    """
    num_q, heads_kv = q.shape[0], keys.shape[1]
    group = q.shape[1] // heads_kv
    pages, fixed, sink_pages, num_total = read_pages(positions, keys.shape[0], page, sink, recent)
    mass = page_mass(q, keys, positions, page)
    pos, ids = torch.tensor(positions), torch.arange(num_total)
    in_context = torch.minimum((pos[:, None] + 1 - ids * page).clamp(0, page), torch.tensor(page))  # [S, NP]
    out = {("FIXED_ONLY", 0): (mass * fixed[:, None]).sum(-1)}  # no picks: sinks, recent and current pages
    for name, (kind, weight, combine, own) in estimators.items():
        for budget in [b for b in budgets if own is None or b in own]:
            # each budget chooses anew: the picks come in column order, not best first
            picks = choose(kind, weight, combine, q, keys, pages, sink_pages, page, budget)  # [S, Hkv, k]
            read = torch.cat([fixed, fixed.new_zeros(num_q, 1)], 1)[:, None].repeat(1, heads_kv, 1)  # last: no pick
            read.scatter_(2, torch.where(picks >= 0, picks + sink_pages, num_total), True)
            read = read[..., :num_total]
            read_q = read.repeat_interleave(group, dim=1)  # [S, Hq, NP]
            out[(name, budget)] = (mass * read_q).sum(-1)
            out[("density", budget)] = (in_context[:, None] * read).sum(-1)[:, 0].float() / (pos + 1)
    return out


class Capture:
    """Records each layer's post-RoPE queries at ``positions`` and all keys during one forward."""

    name = "page_recall_capture"

    def __init__(self):
        self.positions: list[int] = []
        self.q: dict[int, torch.Tensor] = {}  # layer -> float32 [S, Hq, D]
        self.k: dict[int, torch.Tensor] = {}  # layer -> float32 [T, Hkv, D]

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """AttentionInterface function: query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]``."""
        self.q[module.layer_idx] = query[0, :, self.positions].transpose(0, 1).float().clone()
        self.k[module.layer_idx] = key[0].transpose(0, 1).float().clone()
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             is_causal=attention_mask is None, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None


def load_model(path: str, capture: Capture):
    """The float32 model with ``capture``'s attention, and its tokenizer."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(capture.name, capture.attention)
    AttentionMaskInterface.register(capture.name, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=capture.name)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def teacher_forced(tokenizer, sample: dict) -> tuple[torch.Tensor, list[int], list[int]]:
    """A sample's prompt followed by its gold answer (the references joined by ", " after a space, at
    most :data:`MAX_ANSWER_TOKENS` tokens): ``(ids [1, T], answer token ids, decode positions)``, the
    positions being the last prompt token's and every answer token's but the last."""
    answer = tokenizer(" " + ", ".join(sample["answers"]), add_special_tokens=False)["input_ids"][:MAX_ANSWER_TOKENS]
    ids = torch.tensor([sample["input_ids"] + answer])
    return ids, answer, list(range(len(sample["input_ids"]) - 1, ids.shape[1]))


def study(model, tokenizer, capture: Capture, sample: dict, budgets: list[int]) -> tuple[dict, float]:
    """One sample: ``{(name, budget): float32 [layers, S, Hq]}`` (position 0: the last prompt
    token) and the fraction of answer tokens the model predicts (teacher-forced argmax)."""
    ids, answer, capture.positions = teacher_forced(tokenizer, sample)
    prompt_len = capture.positions[0] + 1
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        predicted = model.lm_head(hidden[0, prompt_len - 1:-1]).argmax(-1)
        accuracy = (predicted == torch.tensor(answer)).float().mean().item()
        per_layer = [layer_recall(capture.q[i], capture.k[i], capture.positions, budgets)
                     for i in sorted(capture.k)]
    return {key: torch.stack([r[key] for r in per_layer]) for key in per_layer[0]}, accuracy


def summarize(results: dict, budgets: list[int], group: int) -> dict:
    """Aggregate ``{task: [sample dicts of (name, budget) -> [L, S, Hq]]}`` into the JSON report."""
    keys = [k for k in next(iter(results.values()))[0] if k[0] != "density"]
    report = {"density": {str(b): torch.cat([r[("density", b)].flatten() for rs in results.values() for r in rs])
                          .mean().item() for b in budgets}, "recall": {}}
    for name, budget in keys:
        runs = [r[(name, budget)] for rs in results.values() for r in rs]  # [L, S, Hq] each
        mins = [x.unflatten(2, (-1, group)).amin(3) for x in runs]  # [L, S, Hkv]

        def mean(parts, sl=slice(None)):
            return torch.cat([p[:, sl].flatten() for p in parts]).mean().item()

        entry = {"mean": mean(runs), "group_min": mean(mins), "last_prompt": mean(runs, slice(0, 1)),
                 "last_prompt_group_min": mean(mins, slice(0, 1)), "answer": mean(runs, slice(1, None)),
                 "answer_group_min": mean(mins, slice(1, None)),
                 "by_task": {t: mean([r[(name, budget)] for r in rs]) for t, rs in results.items()}}
        if budget in (0, 512):
            entry["per_layer"] = torch.cat([x.flatten(1) for x in runs], 1).mean(1).tolist()
        report["recall"].setdefault(name, {})[str(budget)] = entry
    return report


def study_parser(description: str, num_samples: int, budgets: str) -> argparse.ArgumentParser:
    """The command line shared by the CPU studies over RULER samples (this one and
    ``benchmarks/speculative_picks.py``): model, tasks, samples per task, length, budgets, seed, output."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=str(default_dest("qwen2.5-coder-0.5b")),
                   help="the converted model (python -m nanovllm.fetch qwen2.5-coder-0.5b)")
    p.add_argument("--tasks", default=TASKS, help=f"comma-separated RULER tasks (default {TASKS})")
    p.add_argument("--num-samples", type=int, default=num_samples,
                   help=f"samples per task (default {num_samples})")
    p.add_argument("--length", type=int, default=8192, help="sequence length of the samples (default 8192)")
    p.add_argument("--budgets", default=budgets,
                   help=f"comma-separated tokens per KV head (default {budgets})")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    return p


def print_report(report: dict, out: str | None) -> None:
    """Print ``report`` as JSON, and write it to ``out`` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def main(argv=None) -> None:
    """Parse arguments, build the samples, run the study, print the JSON."""
    args = study_parser(__doc__.split("\n\n")[0], 4, "256,512,1024").parse_args(argv)
    from tools import ruler

    budgets = [int(b) for b in args.budgets.split(",")]
    capture = Capture()
    model, tokenizer = load_model(args.model, capture)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    input_len = args.length - max(ruler.MAX_NEW_TOKENS.values())  # as benchmarks/ruler_sweep.py
    results, accuracy, start = {}, {}, time.time()
    for task in args.tasks.split(","):
        samples = ruler.generate_samples(tokenizer, task, args.num_samples, input_len, seed=args.seed)
        results[task], accuracy[task] = [], []
        for i, sample in enumerate(samples):
            recall, acc = study(model, tokenizer, capture, sample, budgets)
            results[task].append(recall)
            accuracy[task].append(acc)
            print(f"{task} {i}: answer-token accuracy {acc:.2f}, {time.time() - start:.0f} s", file=sys.stderr)
    report = {"model": args.model, "length": args.length, "prompt_tokens": input_len, "tasks": list(results),
              "num_samples": args.num_samples, "seed": args.seed, "budgets": budgets,
              "seconds": round(time.time() - start, 1), "answer_token_accuracy": accuracy,
              **summarize(results, budgets, group)}
    print_report(report, args.out)


if __name__ == "__main__":
    main()
