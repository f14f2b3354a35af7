"""Helpers shared by the GPU test modules."""
import torch


def assert_close(actual, expected, rel=1e-2, atol=3e-2):
    """No NaN, relative Frobenius error under rel and max abs error under atol."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not torch.isnan(actual).any()
    diff = actual.float() - expected.float()
    relative = diff.norm() / (expected.float().norm() + 1e-6)
    assert relative <= rel, f"relative error {relative:.3e}"
    assert diff.abs().max() <= atol, f"max abs error {diff.abs().max():.3e}"
