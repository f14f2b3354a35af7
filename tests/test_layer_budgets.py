"""benchmarks/layer_budgets.py's fit on small made-up recall curves (CPU, milliseconds)."""
import itertools

import pytest
import torch

from benchmarks.layer_budgets import allocate, held_out

GRID = [128, 256, 384, 512, 768]


def test_allocate_finds_the_best_budgets_at_the_total():
    """The knapsack's choice equals the best of every combination that adds up to the total."""
    curve = torch.rand(4, len(GRID), generator=torch.Generator().manual_seed(0))
    total = 4 * 384
    best = max((combo for combo in itertools.product(range(len(GRID)), repeat=4)
                if sum(GRID[g] for g in combo) == total),
               key=lambda combo: sum(curve[layer, g].item() for layer, g in enumerate(combo)))
    assert allocate(curve, GRID, total) == [GRID[g] for g in best]


def test_allocate_gives_the_budget_to_the_layer_that_gains_from_it():
    """Layer 0 keeps the same mass at every budget, layer 1 gains up to the largest: layer 0 gets
    the smallest budget and layer 1 the rest (768 of 896; of 768, 512: 640 is not in the grid)."""
    curve = torch.tensor([[0.9, 0.9, 0.9, 0.9, 0.9], [0.1, 0.2, 0.3, 0.4, 0.6]])
    assert allocate(curve, GRID, 896) == [128, 768]
    assert allocate(curve, GRID, 768) == [256, 512]


def test_allocate_refuses_a_total_no_budgets_reach():
    with pytest.raises(ValueError, match="add up to 5000"):
        allocate(torch.zeros(2, len(GRID)), GRID, 5000)


def test_held_out_pairs_the_fitted_budgets_with_the_uniform_one():
    curves = [torch.tensor([[0.5, 0.6, 0.7, 0.8, 0.9]] * 2) + i * 0.01 for i in range(3)]
    uniform = held_out(curves, [384, 384], GRID, 384)
    assert uniform["difference"] == 0.0 and uniform["fitted"] == uniform["uniform"]
    shifted = held_out(curves, [128, 768], GRID, 384)
    assert shifted["difference"] == pytest.approx((0.5 + 0.9) / 2 - 0.7)
    assert shifted["difference_se"] == pytest.approx(0.0, abs=1e-6)
