"""benchmarks/page_recall.py's recall computation on tiny random tensors (CPU, seconds)."""
import math

import pytest
import torch

from benchmarks.page_recall import ESTIMATORS, layer_recall

PAGE, SINK, RECENT = 16, 16, 32  # the engine's smallest page (its policies choose)
HQ, HKV, D, T = 6, 2, 8, 245
POSITIONS = [160, 188, 208, 244]


def tiny(seed: int = 0):
    """Random queries ``[S, HQ, D]`` and keys ``[T, HKV, D]`` (float32), spread enough that
    attention is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(POSITIONS), HQ, D, generator=g) * 2, torch.randn(T, HKV, D, generator=g) * 2


def run(q, k, budgets, names):
    """layer_recall of the named estimators at every one of ``budgets``."""
    return layer_recall(q, k, POSITIONS, budgets, {n: ESTIMATORS[n][:3] + (None,) for n in names}, PAGE, SINK,
                        RECENT)


def brute_force(q, k, budget, name):
    """Recall ``[S, HQ]`` from the definitions, one position, KV head and page at a time."""
    kind, weight, combine, _ = ESTIMATORS[name]
    scale, group = 1 / math.sqrt(D), HQ // HKV
    out = torch.zeros(len(POSITIONS), HQ)
    for s, t in enumerate(POSITIONS):
        current = t // PAGE
        fixed = set(range(SINK // PAGE)) | set(range(current - RECENT // PAGE, current + 1))
        candidates = [p for p in range(current) if p not in fixed]
        for kv in range(HKV):
            heads = range(kv * group, (kv + 1) * group)
            shares = {}
            for h in heads:
                logit = {}
                for p in candidates:
                    keys = k[p * PAGE:(p + 1) * PAGE, kv].double()
                    qh = q[s, h].double()
                    if kind == "oracle":
                        logit[p] = torch.logsumexp(keys @ qh * scale, 0).item()
                    elif kind == "quest":
                        lo, hi = keys.min(0).values, keys.max(0).values
                        upper = sum(max(qh[d] * lo[d], qh[d] * hi[d]).item() for d in range(D))
                        lower = sum(min(qh[d] * lo[d], qh[d] * hi[d]).item() for d in range(D))
                        logit[p] = scale * ((1 + weight) / 2 * upper + (1 - weight) / 2 * lower)
                    else:
                        mu, var = keys.mean(0), keys.var(0, unbiased=False)
                        logit[p] = scale * (qh @ mu).item() + scale ** 2 * (qh * qh @ var).item() / 2
                total = sum(math.exp(v) for v in logit.values())
                shares[h] = {p: math.exp(v) / total for p, v in logit.items()}
            agg = max if combine == "max" else sum
            score = {p: agg(shares[h][p] for h in heads) for p in candidates}
            picked = sorted(candidates, key=lambda p: -score[p])[:math.ceil(budget / PAGE)]
            read = fixed | set(picked)
            for h in heads:
                probs = torch.softmax(k[:t + 1, kv].double() @ q[s, h].double() * scale, 0)
                out[s, h] = sum(probs[i].item() for i in range(t + 1) if i // PAGE in read)
    return out


def test_oracle_full_budget_is_exact():
    q, k = tiny()
    recall = run(q, k, [T], ["ORACLE", "ORACLE_sum"])
    for name in ("ORACLE", "ORACLE_sum"):
        assert torch.allclose(recall[(name, T)], torch.ones(len(POSITIONS), HQ), atol=1e-5)
    assert torch.allclose(recall[("density", T)], torch.ones(len(POSITIONS)))


def test_oracle_recall_is_monotone_in_the_budget():
    q, k = tiny(1)
    budgets = [PAGE * n for n in range(1, 12)]
    recall = run(q, k, budgets, ["ORACLE"])
    stacked = torch.stack([recall[("FIXED_ONLY", 0)]] + [recall[("ORACLE", b)] for b in budgets])
    assert (stacked.diff(dim=0) >= -1e-6).all()
    assert (stacked > 0).all() and (stacked <= 1 + 1e-5).all()


@pytest.mark.parametrize("name", ["ORACLE", "QUEST_w1.0", "QUEST_w0.5", "QUEST_w0.0", "MOMENTS", "ORACLE_sum"])
def test_recall_matches_brute_force(name):
    """Several budgets in one call, each equal to its own brute force (the picks are not best
    first, so a smaller budget's are not a prefix of a larger one's)."""
    q, k = tiny(2)
    budgets = [16, 48]
    recall = run(q, k, budgets, [name])
    for budget in budgets:
        assert torch.allclose(recall[(name, budget)], brute_force(q, k, budget, name), atol=1e-5)
        assert recall[(name, budget)].min() < 0.999  # the budget leaves something out: the test compares selections
