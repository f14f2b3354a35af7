"""Gated activations."""
import torch
from torch import nn

from nanovllm.ops import silu_and_mul


class SiluAndMul(nn.Module):
    """SwiGLU (Shazeer, 2020): silu(gate) * up, for x = cat([gate, up], -1) of shape [T, 2 * d]
    (see :func:`nanovllm.ops.silu_and_mul`: one fused kernel on CUDA, torch's two ops on CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
