"""Gated activations."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU (Shazeer, 2020): silu(gate) * up, for x = cat([gate, up], -1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate).mul_(up)
