"""GLM-4 (THUDM/glm-4-9b-chat-hf, glm-4-9b-chat-1m-hf) and GLM-4-0414, as transformers'
``modeling_glm.py`` and ``modeling_glm4.py``: Llama's layout with q/k/v biases (the config's
``attention_bias``) and none on ``o_proj``, RoPE on the first ``partial_rotary_factor`` (0.5) of
each head with interleaved pairs ``(2i, 2i + 1)``, and a fused ``gate_up_proj`` in the checkpoint
(gate rows first). GLM-4-0414 adds an RMSNorm after attention and one after the MLP, each before
its residual add. The several end-of-sequence ids of the chat models come from the checkpoint's
generation config (or, without one, its config)."""
from nanovllm.models.decoder import CausalLM, Family
from nanovllm.models.registry import register_model


@register_model("GlmForCausalLM")
class GlmForCausalLM(CausalLM):
    family = Family(o_proj_bias=False, rope_interleaved=True)


@register_model("Glm4ForCausalLM")
class Glm4ForCausalLM(CausalLM):
    family = Family(o_proj_bias=False, rope_interleaved=True, sandwich_norms=True)
