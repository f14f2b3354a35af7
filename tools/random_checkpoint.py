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

SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
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
