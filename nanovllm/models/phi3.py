"""Phi-3 / Phi-3.5 (microsoft/Phi-3-mini-4k/128k-instruct, Phi-3.5-mini-instruct), as
transformers' ``modeling_phi3.py``: Llama's layout without biases, fused ``qkv_proj`` (``[q; k; v]``
rows) and ``gate_up_proj`` (gate rows first) in the checkpoint, "rotate half" RoPE, and for the
128K models LongRoPE (``rope_scaling`` type ``longrope``; legacy ``su``): per-pair short and long
factors and an attention factor on cos/sin, built into the RoPE table
(:mod:`nanovllm.layers.rotary_embedding` says which factors an engine uses and how that compares
with transformers)."""
from nanovllm.models.decoder import CausalLM, Family
from nanovllm.models.registry import register_model


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(CausalLM):
    family = Family(qkv_bias=False, o_proj_bias=False)
