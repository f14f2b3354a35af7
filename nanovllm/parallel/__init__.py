"""Tensor and data parallelism: how ranks and replicas are launched, joined and driven."""
