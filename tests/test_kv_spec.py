"""The per-layer KV spec (nanovllm/kvcache/spec.py): what the cache takes from the model."""
import pytest
import torch

from _util import build_llm
from nanovllm.kvcache.spec import LayerKVSpec, uniform_storage


def test_the_cache_takes_one_spec_per_attention_layer(qwen3_dir):
    with build_llm(qwen3_dir) as llm:
        cache, cfg = llm.model_runner.cache, llm.config.hf_config
        assert len(cache.specs) == cfg.num_hidden_layers
        assert set(cache.specs) == {LayerKVSpec(cfg.num_key_value_heads, cfg.head_dim, torch.float32)}
        assert cache.geometry.layer_block_bytes == cache.specs[0].token_bytes * cache.geometry.block_size


def test_layers_must_share_their_storage():
    a, b = LayerKVSpec(2, 64, torch.float32, None), LayerKVSpec(2, 64, torch.float32, 128)
    assert uniform_storage([a, b]) == a, "windows may differ, storage is layer 0's"
    with pytest.raises(ValueError, match="attention layer 1 stores 4 KV heads x 64"):
        uniform_storage([a, LayerKVSpec(4, 64, torch.float32)])
    with pytest.raises(ValueError, match="no attention layers"):
        uniform_storage([])
    assert LayerKVSpec(8, 128, torch.bfloat16).token_bytes == 4096
