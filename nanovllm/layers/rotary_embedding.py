"""Rotary position embedding (Su et al., RoFormer 2021), default and Llama 3 frequency scaling.

The Llama 3 scaling follows transformers' ``_compute_llama3_parameters`` exactly: long
wavelengths are divided by ``factor``, short ones kept, the band between interpolated.
"""
import math

import torch
from torch import nn

from nanovllm.ops import KVStore, apply_rotary


def rope_parameters(hf_config) -> dict:
    """The RoPE settings of an HF config as one dict (transformers 4 and 5 spellings)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies. Raises ValueError for unknown rope types."""
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[num_tokens, num_heads, head_dim]`` and k at absolute ``positions``
    (one fused kernel on CUDA, see :func:`nanovllm.ops.apply_rotary`).

    Args:
        head_dim: rotary dimension (the full head dimension here).
        max_position: size of the cos/sin table; positions must be below it.
        params: from :func:`rope_parameters`.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.stack((freqs.cos(), freqs.sin())), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None,
                kv_store: KVStore | None = None):
        """RoPE of q and k; with ``q_norm`` and ``k_norm`` (Qwen3's per-head :class:`RMSNorm`
        modules, one eps) they are applied first, and with ``kv_store`` the rotated keys and the
        values are written into the KV cache, all in the same launch."""
        qk_norm = None if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return apply_rotary(positions, q, k, self.cos_sin_cache, qk_norm, kv_store)
