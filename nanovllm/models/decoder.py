"""The Llama-family decoder shared by Llama (2/3, SmolLM2, Mistral with its sliding window),
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm), with tensor-parallel layers."""
import functools

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


class DecoderAttention(nn.Module):
    """Args: ``rotary_emb`` is the model's one RoPE table, shared by every layer."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = _head_dim(config)
        attention_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=qkv_bias or attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

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
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm, rotary_emb)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm. One RoPE cos/sin table ``[2, max_position,
    head_dim / 2]`` (float32) serves every layer: a table per layer took num_layers times the
    memory (32 x 512 MiB for a 1M-token Llama-3-8B)."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(_head_dim(config), max_position, rope_parameters(config))
        self.layers = nn.ModuleList(DecoderLayer(config, qkv_bias, qk_norm, rotary_emb)
                                    for _ in range(config.num_hidden_layers))
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

    ``packed_modules_mapping`` tells the loader which checkpoint tensors fill packed parameters.
    """

    qkv_bias = False
    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_position: int | None = None):
        super().__init__()
        max_position = max_position or config.max_position_embeddings
        self.model = DecoderModel(config, self.qkv_bias, self.qk_norm, max_position)
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
    qkv_bias = True


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
