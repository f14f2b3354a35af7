"""CUDA tests (marker ``gpu``). They run on the GPU machine (the H200); where torch has no CUDA
device they are skipped with that reason, never failed."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: pytest tests/gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
