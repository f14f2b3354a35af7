"""benchmarks/speculative_picks.py's metrics on tiny random tensors (CPU, seconds)."""
import torch

from benchmarks.page_recall import read_pages
from benchmarks.speculative_picks import layer_metrics, picked

PAGE, SINK, RECENT, BUDGET = 16, 16, 32, 48
HQ, HKV, D, T = 6, 2, 8, 245
POSITIONS = [240, 241, 242, 243, 244]  # consecutive decode steps


def tiny(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(POSITIONS), HQ, D, generator=g) * 2, torch.randn(T, HKV, D, generator=g) * 2


def test_a_speculation_equal_to_the_query_covers_every_pick():
    q, k = tiny(0)
    m = layer_metrics(q, q, k, POSITIONS, BUDGET, PAGE, SINK, RECENT)
    assert torch.equal(m["overlap"], torch.ones(len(POSITIONS), HKV))
    assert torch.equal(m["cover"], torch.ones(len(POSITIONS) - 1, HKV))
    assert torch.equal(m["mass_spec"], m["mass_real"])
    assert torch.allclose(m["prefetch"], 1 - m["consecutive"])  # it moves what the reuse cache misses
    assert (m["consecutive"] < 1).any()  # the picks change between steps, so the check above means something


def test_metrics_equal_the_set_arithmetic_of_the_picks():
    q, k = tiny(1)
    q_spec = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    m = layer_metrics(q, q_spec, k, POSITIONS, BUDGET, PAGE, SINK, RECENT)
    candidates, _, first, num_total = read_pages(POSITIONS, T, PAGE, SINK, RECENT)
    real, spec = (picked(x, k, candidates, first, num_total, BUDGET, PAGE) for x in (q, q_spec))
    for s in range(len(POSITIONS)):
        for h in range(HKV):
            r, p = (set(torch.nonzero(x[s, h]).flatten().tolist()) for x in (real, spec))
            assert len(r) == BUDGET // PAGE
            assert abs(m["overlap"][s, h].item() - len(r & p) / len(r)) < 1e-6
            if s:
                before = set(torch.nonzero(real[s - 1, h]).flatten().tolist())
                for name, pages in (("consecutive", r & before), ("cover", r & (p | before)), ("prefetch", p - before)):
                    assert abs(m[name][s - 1, h].item() - len(pages) / len(r)) < 1e-6
    assert (m["overlap"] < 1).any()  # the noisy speculation misses some picks
    assert ((m["mass_real"] > 0) & (m["mass_real"] <= 1 + 1e-5)).all()
