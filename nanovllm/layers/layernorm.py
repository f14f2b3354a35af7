"""RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add."""
import torch
from torch import nn

from nanovllm.ops import rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does
    (one fused kernel on CUDA, see :func:`nanovllm.ops.rms_norm`). x: ``[T, H]`` or
    ``[T, heads, H]`` (per-head q/k norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)
