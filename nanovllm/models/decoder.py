"""The Llama-layout decoder shared by every supported family, with tensor-parallel layers:
Llama (2/3, SmolLM2, Mistral with its sliding window), Qwen2 (qkv bias), Qwen3 (per-head q/k
RMSNorm) here; GLM / GLM-4 (``glm.py``) and Phi-3 (``phi3.py``) declare their differences as a
:class:`Family`."""
import functools
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from nanovllm.models.registry import register_model
from nanovllm.models.sliding_window import layer_sliding_windows


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Family:
    """What a model family changes in the shared decoder (transformers' modeling file of the
    family is the specification).

    Attributes:
        qkv_bias: q/k/v projections with a bias; None: the config's ``attention_bias``.
        o_proj_bias: the output projection with a bias; None: the config's ``attention_bias``.
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
        rope_interleaved: RoPE pairs dims ``(2i, 2i + 1)`` (GLM) instead of ``(i, i + R/2)``.
        sandwich_norms: an RMSNorm on the attention output and one on the MLP output, each
            before its residual add (GLM-4-0414's ``post_self_attn_layernorm`` and
            ``post_mlp_layernorm``).
    """

    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    qk_norm: bool = False
    rope_interleaved: bool = False
    sandwich_norms: bool = False

    def bias(self, declared: bool | None, config) -> bool:
        return bool(getattr(config, "attention_bias", False)) if declared is None else declared


class DecoderAttention(nn.Module):
    """Args: ``rotary_emb`` is the model's one RoPE table, shared by every layer."""

    def __init__(self, config, family: Family, rotary_emb: RotaryEmbedding):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=family.bias(family.qkv_bias, config))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size,
                                        bias=family.bias(family.o_proj_bias, config))
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        if family.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = family.qk_norm

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = {"q_norm": self.q_norm, "k_norm": self.k_norm} if self.qk_norm else {}  # Qwen3, in RoPE's launch
        o = self.attn(q, k, v, functools.partial(self.rotary_emb, positions, **norms))
        return self.o_proj(o.flatten(1, -1))


class DecoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm, so
    ``forward(positions, hidden, residual) -> (block output, residual)``."""

    def __init__(self, config, family: Family, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(config, family, rotary_emb)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = family.sandwich_norms
        if family.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if self.sandwich_norms:
            hidden = self.post_self_attn_layernorm(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.sandwich_norms:
            hidden = self.post_mlp_layernorm(hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm. One RoPE cos/sin table ``[2, max_position,
    rotary_dim / 2]`` (float32) serves every layer: a table per layer took num_layers times the
    memory (32 x 512 MiB for a 1M-token Llama-3-8B)."""

    def __init__(self, config, family: Family, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(_head_dim(config), max_position, rope_parameters(config), family.rope_interleaved)
        self.layers = nn.ModuleList(DecoderLayer(config, family, rotary_emb) for _ in range(config.num_hidden_layers))
        for layer, window in zip(self.layers, layer_sliding_windows(config, max_position)):
            layer.self_attn.attn.sliding_window = window
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward(input_ids [N], positions [N]) -> hidden [N, hidden]``;
    ``compute_logits(hidden [M, hidden]) -> [M, vocab]``.

    ``family`` declares what the architecture changes in the shared decoder;
    ``packed_modules_mapping`` tells the loader which checkpoint tensors fill packed parameters
    (a fused checkpoint ``qkv_proj`` / ``gate_up_proj`` fills its parameter directly).
    """

    family = Family()
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_position: int | None = None):
        super().__init__()
        max_position = max_position or config.max_position_embeddings
        self.model = DecoderModel(config, self.family, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(CausalLM):
    pass


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(CausalLM):
    family = Family(qkv_bias=True)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    family = Family(qk_norm=True)
