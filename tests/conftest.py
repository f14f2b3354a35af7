"""Shared fixtures: tiny random-weight checkpoints of the supported architectures.

Every checkpoint is built offline with transformers (fixed seed, float32, safetensors) together
with a small word-level tokenizer whose vocabulary matches the model's, and a
``generation_config.json`` naming the end-of-sequence id. They are session scoped, so each is
written once per test run.
"""
import functools
import json
import os
import random

import pytest
import torch

from _util import EOS_ID, SLIDING_WINDOW, SPECIAL_TOKENS, VOCAB_SIZE, build_llm

MAX_POSITIONS = 4096

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
    "rope_theta": 500000.0,
}


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """Every test starts from the same global torch RNG state, so unseeded draws do not depend on
    which tests ran before it."""
    torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds")


@functools.lru_cache(maxsize=None)
def _build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries (the special tokens first),
    trained on a fixed random corpus of made-up words. Byte-level BPE is what transformers'
    model-specific classes (e.g. Qwen2Tokenizer, picked by AutoTokenizer for model_type qwen2)
    rebuild from tokenizer.json, so every architecture loads it the same way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def _save_checkpoint(path, config_cls, model_cls, seed: int, eos=EOS_ID, random_vectors: bool = False,
                     **config_kwargs):
    """``random_vectors``: biases and norm weights drawn at random too (transformers initialises
    them to 0 and 1, which would leave a family's biases and extra norms untested)."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    config = config_cls(**{**dict(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS, bos_token_id=1,
                                  eos_token_id=eos, pad_token_id=3, rms_norm_eps=1e-6, hidden_act="silu"),
                           **config_kwargs})
    model = model_cls(config).float().eval()
    # Random init is tiny (std 0.02); scale up so logits are not flat and argmax is stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(3.0)
            elif p.dim() == 1 and random_vectors:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(path, safe_serialization=True)
    _build_tokenizer(VOCAB_SIZE).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=3).save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(path))
    return str(path)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """Qwen3: per-head q/k RMSNorm, GQA 2:1, head_dim 32, untied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, 0,
                            hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory):
    """Llama 3: llama3 RoPE scaling (factor 8, low 1, high 4, original 1024, theta 5e5), untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("llama3"), LlamaConfig, LlamaForCausalLM, 1,
                            hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory):
    """SmolLM2-like Llama: GQA 3:1 (6 q / 2 kv heads), head_dim 64, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("llama_tied"), LlamaConfig, LlamaForCausalLM, 2,
                            hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    """Qwen2: qkv bias, MHA (2 q / 2 kv heads) with head_dim 128, untied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("qwen2"), Qwen2Config, Qwen2ForCausalLM, 3,
                            hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2,
                            tie_word_embeddings=False)


GLM_EOS = [EOS_ID, 5, 6]  # GLM's chat models end on any of three ids
PHI3_ORIGINAL = 64  # phi3_dir's original_max_position_embeddings: its long factors apply past 64 tokens


def _longrope(pairs: int, seed: int) -> dict:
    """LongRoPE factors of Phi-3's ranges (short 1-3, long 1-64), increasing with the pair."""
    gen = torch.Generator().manual_seed(seed)
    short = (1 + 2 * torch.rand(pairs, generator=gen)).sort().values
    long = (1 + 63 * torch.rand(pairs, generator=gen)).sort().values
    return {"rope_type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist()}


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory):
    """GLM-4 (glm-4-9b-chat-hf's layout): q/k/v bias, none on o_proj, RoPE on half of each
    32-dim head with interleaved pairs, fused gate_up_proj, GQA 2:1, three eos ids."""
    from transformers import GlmConfig, GlmForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("glm"), GlmConfig, GlmForCausalLM, 4, eos=GLM_EOS,
                            random_vectors=True, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def glm4_dir(tmp_path_factory):
    """GLM-4-0414: GLM's attention plus post-attention and post-MLP RMSNorms; GQA 4:1 (8 q / 2 kv
    heads of 16 dims, 8 of them rotated), partial_rotary_factor 0.5, rope_theta 1e4."""
    from transformers import Glm4Config, Glm4ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("glm4"), Glm4Config, Glm4ForCausalLM, 5, eos=GLM_EOS,
                            random_vectors=True, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def phi3_dir(tmp_path_factory):
    """Phi-3-mini-128k's layout in miniature: fused qkv_proj and gate_up_proj, GQA 2:1 (head_dim
    32), LongRoPE with original_max_position_embeddings 64 < max_position_embeddings 4096 (so an
    engine of more than 64 tokens rotates with the long factors, and the attention factor is
    sqrt(1 + ln(64) / ln(64)))."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("phi3"), Phi3Config, Phi3ForCausalLM, 6, random_vectors=True,
                            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, original_max_position_embeddings=PHI3_ORIGINAL,
                            rope_scaling=_longrope(16, 6), sliding_window=None, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def phi3_4k_dir(tmp_path_factory):
    """Phi-3 whose LongRoPE original context (4096) covers max_position_embeddings: every engine
    and transformers use the short factors at any length (attention factor 1); MHA, head_dim 48
    with 24 pairs."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("phi3_4k"), Phi3Config, Phi3ForCausalLM, 7,
                            random_vectors=True, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4,
                            original_max_position_embeddings=MAX_POSITIONS, rope_scaling=_longrope(24, 7),
                            sliding_window=None, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory):
    """Mistral: a sliding window of 300 tokens in every layer, GQA 2:1, head_dim 32, untied."""
    from transformers import MistralConfig, MistralForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("mistral"), MistralConfig, MistralForCausalLM, 5,
                            hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def qwen2_mixed_dir(tmp_path_factory):
    """Qwen2 with use_sliding_window and max_window_layers=1: layer 0 full attention, layers 1-2
    a 300-token window; GQA 2:1, head_dim 32, qkv bias."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save_checkpoint(tmp_path_factory.mktemp("qwen2_mixed"), Qwen2Config, Qwen2ForCausalLM, 6,
                            hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                            sliding_window=SLIDING_WINDOW, max_window_layers=1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def unsupported_dir(tmp_path_factory, qwen3_dir):
    """A copy of the qwen3 checkpoint whose config names an unregistered architecture."""
    import shutil

    path = tmp_path_factory.mktemp("unsupported")
    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), path / name)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def llm_factory():
    """``llm_factory(model_dir, **kwargs)``: an engine with CPU-friendly defaults, shut down at
    the end of the test (shutdown is idempotent, so tests may also call it themselves)."""
    engines = []

    def make(model_dir, **kwargs):
        llm = build_llm(model_dir, **kwargs)
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.shutdown()
