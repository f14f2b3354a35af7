"""Random-weight checkpoints of real architectures, for benchmarks and tests.

Speed does not depend on weight values, so benchmarks run on checkpoints built from a real
model's config with random weights (transformers' own initialisation, fixed seed). A small
word-level tokenizer is written beside them so the engine can load the directory as usual.
"""
import json
import logging
import os
import shutil

import torch

logger = logging.getLogger(__name__)

# Phi-3-mini-128k-instruct's LongRoPE factors as first released (also Phi-3-vision-128k-instruct's;
# the June 2024 update changed their values, not their number; speed does not depend on them)
_PHI3_128K_LONG_FACTOR = [
    1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547, 1.2299998998641968,
    1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684, 1.6499998569488525,
    1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787, 5.489999771118164,
    5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
    15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055, 30.009998321533203,
    32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672, 53.840003967285156,
    56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094, 59.920005798339844,
    61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
    63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625,
    64.80001068115234, 64.81001281738281, 64.81001281738281,
]
_PHI3_128K_SHORT_FACTOR = [
    1.05, 1.05, 1.05, 1.1, 1.1,
    1.1, 1.2500000000000002, 1.2500000000000002, 1.4000000000000004, 1.4500000000000004,
    1.5500000000000005, 1.8500000000000008, 1.9000000000000008, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.1000000000000005, 2.1000000000000005, 2.2,
    2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3999999999999995,
    2.3999999999999995, 2.6499999999999986, 2.6999999999999984, 2.8999999999999977, 2.9499999999999975,
    3.049999999999997, 3.049999999999997, 3.049999999999997,
]

SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
    # SmolLM2-135M-Instruct (../shared/models.md): the README's model, for start-up times on a device without its weights
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64: 12 KiB of KV per token in bf16 (a small model over the host tier)
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        sliding_window=None, use_sliding_window=False),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3-8B with the context of gradientai/Llama-3-8B-Instruct-Gradient-1048k (its rope_theta)
    "llama-3-8b-1m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=1048576, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=3580165449.0),
    # GLM-4-9B-chat-1m-hf: THUDM/glm-4-9b-chat-1m's config.json (multi_query_group_num 4, seq_length
    # 1048576, rope_ratio 10000) as transformers' convert_glm_weights_to_hf.py writes it (rope_theta =
    # 10000 * rope_ratio); partial_rotary_factor 0.5 is GlmConfig's default
    "glm-4-9b-1m": dict(
        architectures=["GlmForCausalLM"], model_type="glm", vocab_size=151552, hidden_size=4096,
        intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, max_position_embeddings=1048576, rms_norm_eps=1.5625e-07, rope_theta=1e8,
        partial_rotary_factor=0.5, attention_bias=True, tie_word_embeddings=False,
        eos_token_id=[151329, 151336, 151338], pad_token_id=151329),
    # microsoft/Phi-3-mini-128k-instruct: MHA (32 heads of 96), LongRoPE past 4096 tokens
    "phi-3-mini-128k": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling={"type": "longrope", "long_factor": _PHI3_128K_LONG_FACTOR,
                                          "short_factor": _PHI3_128K_SHORT_FACTOR},
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000, tie_word_embeddings=False),
}


def write_word_tokenizer(path: str, vocab_size: int, eos_token_id: int = 0):
    """A word-level tokenizer: ``<eos>`` then ``w1 .. w{vocab_size-1}``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": eos_token_id}
    vocab.update({f"w{i}": i for i in range(vocab_size) if i != eos_token_id})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    fast.save_pretrained(path)


def cached_random_checkpoint(shape: str, **kwargs) -> str:
    """:func:`make_random_checkpoint` of ``shape`` in ``<nanovllm.fetch.cache_root()>/random-<shape>``
    (``-<name>-<value>`` appended per keyword argument, e.g. ``num_hidden_layers=8``, so that each
    variant has its own directory), the one place benchmarks and GPU tests keep it (created once)."""
    from nanovllm.fetch import cache_root

    name = "".join([f"random-{shape}", *(f"-{key}-{value}" for key, value in sorted(kwargs.items()))])
    return make_random_checkpoint(shape, str(cache_root() / name), **kwargs)


def make_random_checkpoint(shape: str, path: str, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0, device: str | None = None, **overrides) -> str:
    """Write ``shape``'s config with random weights to ``path`` (skipped if already there).

    Args:
        shape: a key of :data:`SHAPES`. ``overrides`` replace config fields (e.g. layers).
        device: where to initialise (default: cuda when available); weights are saved as safetensors.
    Raises:
        ValueError: unknown shape.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    fields = {**SHAPES[shape], **overrides}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = f"{path}.tmp{os.getpid()}"  # per process: torchrun's ranks may all write it at once
    model.save_pretrained(tmp)
    write_word_tokenizer(tmp, min(config.vocab_size, 32000))
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 0}, f)
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    logger.info("wrote random-weight %s checkpoint to %s", shape, path)
    return path
