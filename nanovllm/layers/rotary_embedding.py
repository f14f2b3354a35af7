"""Rotary position embedding (Su et al., RoFormer 2021): default frequencies, Llama 3's scaling
and Phi-3's LongRoPE, on all of each head or on its first ``partial_rotary_factor`` (GLM), with
"rotate half" or interleaved pairs.

Every frequency follows transformers (5.x, ``modeling_rope_utils``) exactly:

- Llama 3 (``_compute_llama3_parameters``): long wavelengths are divided by ``factor``, short ones
  kept, the band between interpolated.
- LongRoPE (Ding et al., 2024; ``_compute_longrope_parameters``):
  ``inv_freq[i] = 1 / (ext[i] * theta ** (2i / R))`` with ``ext`` the config's ``short_factor`` or
  ``long_factor`` (one per rotary pair), and cos/sin multiplied by the attention factor
  ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))``, ``s = factor`` or, without one,
  ``max_position_embeddings / original_max_position_embeddings`` (1 when ``s <= 1``; the config's
  ``attention_factor`` when given).

Short or long factors. transformers chooses per forward pass by the sequence length it sees
(``max(position_ids) + 1 > original_max_position_embeddings``: long factors for every position), and
Phi-3's ``generate`` drops its KV cache and recomputes the whole sequence when the sequence first
grows past ``original_max_position_embeddings``, so a sequence of ``L`` tokens is rotated with
the long factors iff ``L > original_max_position_embeddings``, keys and queries alike. One KV cache
holds one set here (prefix-cache blocks are shared by sequences of any length): the long factors
when the engine's context (``max_model_len``, the table's ``max_position``) exceeds
``original_max_position_embeddings``, the short ones otherwise (vLLM's rule). That equals
transformers for every sequence longer than ``original_max_position_embeddings`` in a long-context
engine, and for every sequence in an engine whose context does not exceed it; a shorter sequence
in a long-context engine gets the long factors where transformers uses the short ones.
"""
import math

import torch
from torch import nn

from nanovllm.ops import KVStore, apply_rotary

ROPE_TYPES = ("default", "llama3", "longrope")


def rope_parameters(hf_config) -> dict:
    """The RoPE settings of an HF config as one dict (transformers 4 and 5 spellings):
    ``rope_type``, ``rope_theta``, ``partial_rotary_factor`` (1.0 unless set) and the type's own
    fields; for LongRoPE also the model's ``max_position_embeddings`` and its
    ``original_max_position_embeddings`` (the config's top-level field first, as transformers)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if params["rope_type"] == "longrope":
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        params.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """Dims of each head that rotate: ``int(head_dim * partial_rotary_factor)``.

    Raises:
        ValueError: a factor outside (0, 1], or an odd or zero result, naming both."""
    factor = params.get("partial_rotary_factor", 1.0)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1]; got {factor}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dims int(head_dim={head_dim} * partial_rotary_factor={factor}) = {dim} must be "
                         f"even and at least 2")
    return dim


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


def _longrope_factors(params: dict, dim: int, long: bool) -> torch.Tensor:
    name = "long_factor" if long else "short_factor"
    factors = params.get(name)
    if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
        count = len(factors) if isinstance(factors, (list, tuple)) else factors
        raise ValueError(f"rope_parameters[{name!r}] must list one factor per rotary pair ({dim // 2} for "
                         f"{dim} rotary dims); got {count}")
    return torch.tensor(factors, dtype=torch.float32)


def compute_inv_freq(dim: int, params: dict, long_factors: bool = False) -> torch.Tensor:
    """float32 ``[dim // 2]`` inverse frequencies of ``dim`` rotary dims; LongRoPE's long factors
    with ``long_factors``, its short ones otherwise.

    Raises:
        ValueError: an unknown rope type, or LongRoPE factor lists of the wrong length."""
    base = params["rope_theta"]
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = params["rope_type"]
    if rope_type == "default":
        return 1.0 / (base ** exponent)
    if rope_type == "llama3":
        return _llama3_inv_freq(1.0 / (base ** exponent), params)
    if rope_type == "longrope":
        return 1.0 / (_longrope_factors(params, dim, long_factors) * base ** exponent)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(map(repr, ROPE_TYPES))})")


def attention_scaling(params: dict) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's attention factor; 1.0 otherwise)."""
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def uses_long_factors(params: dict, max_position: int) -> bool:
    """LongRoPE: whether an engine whose context is ``max_position`` tokens rotates with the long
    factors (its context exceeds ``original_max_position_embeddings``; see the module docstring)."""
    return params["rope_type"] == "longrope" and max_position > params["original_max_position_embeddings"]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[num_tokens, num_heads, head_dim]`` and k at absolute ``positions``
    (one fused kernel on CUDA, see :func:`nanovllm.ops.apply_rotary`).

    Args:
        head_dim: the head dimension; its first :func:`rotary_dim` dims rotate, the rest pass through.
        max_position: size of the cos/sin table (the engine's context); positions must be below it.
        params: from :func:`rope_parameters`.
        interleaved: rotary pairs are dims ``(2i, 2i + 1)`` (GLM) instead of ``(i, i + R/2)``.

    The table ``cos_sin_cache`` (float32 ``[2, max_position, R/2]``) is built here with every
    scaling folded in (LongRoPE's factors, chosen once by :func:`uses_long_factors`, and its
    attention factor), so the kernel only rotates.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False):
        super().__init__()
        dim = rotary_dim(head_dim, params)
        inv_freq = compute_inv_freq(dim, params, uses_long_factors(params, max_position))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        scale = attention_scaling(params)
        table = torch.stack((freqs.cos(), freqs.sin())) if scale == 1.0 else torch.stack(
            (freqs.cos() * scale, freqs.sin() * scale))
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.interleaved = interleaved

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None,
                kv_store: KVStore | None = None):
        """RoPE of q and k; with ``q_norm`` and ``k_norm`` (Qwen3's per-head :class:`RMSNorm`
        modules, one eps) they are applied first, and with ``kv_store`` the rotated keys and the
        values are written into the KV cache, all in the same launch."""
        qk_norm = None if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return apply_rotary(positions, q, k, self.cos_sin_cache, qk_norm, kv_store, self.interleaved)
