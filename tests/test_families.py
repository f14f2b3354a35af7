"""GLM-4, GLM-4-0414 and Phi-3 (LongRoPE) against transformers, float32 on the CPU.

Tiny random checkpoints from transformers' own config classes (conftest.py: ``glm_dir``,
``glm4_dir``, ``phi3_dir``, the last with original_max_position_embeddings 64 so that every prompt
here is rotated with the long factors): greedy tokens equal ``generate``'s and logits are within
1e-4 over 64 generated tokens, on the GPU tier alone, with the host tier and the GPU tier at ~30%
of the batch's KV, with QUEST reading every block, with prefix-cache hits and with TP=2 over gloo.
The generic suites (tests/test_models.py, tests/test_vllm_api.py) run ``glm``, ``glm4`` and
``phi3_4k`` too. Below: the RoPE tables against transformers', the fused checkpoint projections,
the end-of-sequence ids and the configs refused.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from _util import GLM_EOS, PHI3_ORIGINAL, build_llm, generate_with_logits, random_prompt

FAMILIES = ("glm", "glm4", "phi3")
BLOCK = 256
DECODE = 64
PROMPT_LENS = (300, 700, 1000, 257)  # all longer than phi3's original_max_position_embeddings (64)
BATCH_BLOCKS = sum(-(-(n + DECODE) // BLOCK) for n in PROMPT_LENS)  # 12
MAX_MODEL_LEN = 1536
HOST = dict(enable_cpu_offload=True, num_cpu_kvcache_blocks=32, num_ring_slots=3)
LOGITS_ATOL = 1e-4


def hf_greedy_with_logits(hf, prompt: list[int], max_new_tokens: int):
    """transformers' greedy ``generate``: (tokens, float32 logits ``[steps, vocab]``)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=3,
                           output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gen)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, checkpoint, prompts, transformers' tokens and logits per prompt)."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    hf = _hf_model(model_dir)
    prompts = [random_prompt(n, seed=900 + n) for n in PROMPT_LENS]
    refs = [hf_greedy_with_logits(hf, p, DECODE) for p in prompts]
    return request.param, model_dir, prompts, refs


def assert_matches_transformers(name, got, refs, what=""):
    tokens, logits = got
    for i, ((ref_tokens, ref_logits), ours, ours_logits) in enumerate(zip(refs, tokens, logits)):
        assert ours == ref_tokens, f"{name}{what}: prompt {i}"
        assert ours_logits.shape == ref_logits.shape
        diff = (ours_logits - ref_logits).abs().max().item()
        assert diff <= LOGITS_ATOL, f"{name}{what}: prompt {i}: max |logits - transformers| = {diff:.3g}"


def test_greedy_tokens_and_logits_match_transformers(family):
    name, model_dir, prompts, refs = family
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=32) as llm:
        assert_matches_transformers(name, generate_with_logits(llm, prompts, DECODE), refs)


def test_host_tier_with_the_gpu_tier_at_30_percent(family):
    """GPU tier ~30% of the batch's KV: blocks spill to the host tier and are read back; a second
    generate of the same prompts, reversed, hits the prefix cache in both tiers."""
    name, model_dir, prompts, refs = family
    gpu_blocks = round(0.3 * BATCH_BLOCKS)
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=gpu_blocks, **HOST) as llm:
        assert_matches_transformers(name, generate_with_logits(llm, prompts, DECODE), refs, " (host tier)")
        stats = llm.get_kv_cache_stats()
        assert stats["gpu_blocks"] == gpu_blocks and stats["spilled_blocks"] > 0 and stats["loaded_blocks"] > 0
        tokens, logits = generate_with_logits(llm, prompts[::-1], DECODE)
        assert_matches_transformers(name, (tokens[::-1], logits[::-1]), refs, " (host tier, prefix hits)")
        assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]


def test_quest_with_a_budget_covering_the_context(family, monkeypatch):
    """QUEST made to select for every sequence with a candidate page, with a budget above the
    context: every layer scores and picks every candidate, read in place, from the reuse cache or
    gathered from the host, so every host (page, KV head) is read."""
    from nanovllm.sparse.choosing import ChoosingPolicy

    name, model_dir, prompts, refs = family
    monkeypatch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4, sparse_policy="QUEST",
                   sparse_token_budget=MAX_MODEL_LEN, **HOST) as llm:
        assert_matches_transformers(name, generate_with_logits(llm, prompts, DECODE), refs, " (QUEST)")
        decode = llm.get_sparse_stats()["decode"]
    read, available = decode["read_host_pages"], decode["available_host_bytes"]
    assert read > 0 and available % read == 0, "every host page of every KV head read once per layer and step"
    assert decode["loaded_host_bytes"] == (read - decode["reused_host_pages"]) * (available // read)


def test_prefix_cache_hits_of_a_shared_prefix(family):
    """Prompts sharing two blocks: the later ones read the first one's cached blocks."""
    name, model_dir, _, _ = family
    shared = random_prompt(2 * BLOCK, seed=950)
    prompts = [shared + random_prompt(n, seed=951 + n) for n in (40, 130)]
    hf = _hf_model(model_dir)
    refs = [hf_greedy_with_logits(hf, p, DECODE) for p in prompts]
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16) as llm:
        first = generate_with_logits(llm, prompts[:1], DECODE)
        before = llm.get_kv_cache_stats()["prefix_cache_hit_tokens"]
        second = generate_with_logits(llm, prompts[1:], DECODE)
        assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] - before == 2 * BLOCK
    assert_matches_transformers(name, (first[0] + second[0], first[1] + second[1]), refs, " (prefix hits)")


@pytest.mark.slow
def test_tensor_parallel_2_matches_transformers(family):
    """TP=2 over gloo (q/k/v heads, the fused projections and the MLP split across two ranks)
    gives transformers' tokens; a repeated prompt hits the prefix cache on both ranks."""
    name, model_dir, prompts, refs = family
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=32, tensor_parallel_size=2) as tp2:
        out = tp2.generate(prompts, [_greedy()] * len(prompts), use_tqdm=False)
        assert [o["token_ids"] for o in out] == [r[0] for r in refs], name
        again = tp2.generate([prompts[2]], _greedy(), use_tqdm=False)[0]
        assert again["token_ids"] == refs[2][0]
        assert tp2.get_kv_cache_stats()["prefix_cache_hit_tokens"] > 0


def _greedy():
    from _util import greedy

    return greedy(DECODE)


# ---- RoPE tables ---------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES + ("phi3_4k",))
def test_rope_tables_match_transformers(name, request):
    """Our cos/sin table (rotary pairs only, attention factor folded in) equals transformers'
    cos/sin at the same positions: GLM's half-head default RoPE; Phi-3's LongRoPE with the short
    factors in an engine within original_max_position_embeddings and the long ones past it."""
    from transformers import AutoConfig

    from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters, uses_long_factors
    from nanovllm.models.decoder import _head_dim

    model_dir = request.getfixturevalue(f"{name}_dir")
    cfg, hf = AutoConfig.from_pretrained(model_dir), _hf_model(model_dir)
    params = rope_parameters(cfg)
    for engine_len, seen in ((PHI3_ORIGINAL, PHI3_ORIGINAL), (2048, 300)):
        ours = RotaryEmbedding(_head_dim(cfg), engine_len, params).cos_sin_cache[:, :seen]
        x = torch.zeros(1, seen, cfg.hidden_size)
        with torch.no_grad():
            cos, sin = hf.model.rotary_emb(x, torch.arange(seen)[None])
        half = ours.shape[-1]
        torch.testing.assert_close(ours[0], cos[0, :, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[1], sin[0, :, :half], rtol=0, atol=1e-6)
        assert uses_long_factors(params, engine_len) == (name == "phi3" and engine_len > PHI3_ORIGINAL)
    if name.startswith("glm"):
        assert 2 * half == _head_dim(cfg) // 2, "GLM rotates half of each head"
    if name == "phi3":
        assert ours[0, 0, 0].item() == pytest.approx(2 ** 0.5), "attention factor sqrt(1 + ln 64 / ln 64)"


def test_phi3_engine_within_the_original_context_uses_the_short_factors(phi3_dir):
    """An engine of 64 tokens (= original_max_position_embeddings) rotates with the short factors,
    as transformers does for any sequence of at most 64 tokens; past it, transformers' and ours
    both take the long factors (the acceptance tests above)."""
    prompt = random_prompt(60, seed=960)
    with torch.no_grad():
        ref = _hf_model(phi3_dir)(torch.tensor([prompt])).logits[0].float()
    with build_llm(phi3_dir, max_model_len=PHI3_ORIGINAL) as llm:
        ours = llm.model_runner.forward_logits(prompt)
    assert (ours - ref).abs().max().item() <= LOGITS_ATOL


def test_bad_rope_parameters_are_refused_naming_the_field():
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    longrope = dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=1.0, short_factor=[1.0] * 16,
                    long_factor=[2.0] * 15, original_max_position_embeddings=64, max_position_embeddings=4096)
    with pytest.raises(ValueError, match=r"rope_parameters\['long_factor'\].*16 for 32 rotary dims.*got 15"):
        RotaryEmbedding(32, 128, longrope)
    RotaryEmbedding(32, 64, longrope)  # the short factors only: fine
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be in \(0, 1\]; got 0"):
        RotaryEmbedding(32, 64, dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0))
    with pytest.raises(ValueError, match=r"int\(head_dim=32 \* partial_rotary_factor=0.3\) = 9 must be even"):
        RotaryEmbedding(32, 64, dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.3))
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not supported \(supported: 'default', 'llama3', "
                                         r"'longrope'\)"):
        RotaryEmbedding(32, 64, dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))


# ---- checkpoints ---------------------------------------------------------------------

def _rewrite_checkpoint(src, dst, change):
    """A copy of checkpoint ``src`` whose tensors went through ``change(dict) -> dict``."""
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    (file,) = [n for n in os.listdir(src) if n.endswith(".safetensors")]
    save_file(change(load_file(os.path.join(src, file))), os.path.join(dst, file), metadata={"format": "pt"})
    return str(dst)


def _fuse(tensors):
    out = dict(tensors)
    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [out.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    return out


def _split(tensors):
    out = dict(tensors)
    for name in [n for n in tensors if ".gate_up_proj." in n]:
        out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = \
            out.pop(name).chunk(2)
    return out


def test_fused_and_separate_checkpoint_projections_load_alike(glm_dir, phi3_dir, tmp_path):
    """A GLM checkpoint with q/k/v fused into qkv_proj (weights and biases; transformers'
    conversion of the original GLM-4 writes it so) and a Phi-3 one with gate_up_proj split into
    gate_proj / up_proj give the same logits as the originals."""
    prompt = random_prompt(100, seed=970)
    for model_dir, change, sub in ((glm_dir, _fuse, "glm_fused"), (phi3_dir, _split, "phi3_split")):
        (tmp_path / sub).mkdir()
        other = _rewrite_checkpoint(model_dir, tmp_path / sub, change)
        with build_llm(model_dir) as a:
            want = a.model_runner.forward_logits(prompt)
        with build_llm(other) as b:
            assert torch.equal(b.model_runner.forward_logits(prompt), want)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fused_checkpoint_tensor_is_split_into_this_ranks_shards(rank, monkeypatch):
    """Under TP=2, a fused qkv_proj (weight and bias) and gate_up_proj fill each rank's parameter
    exactly as the separate q/k/v and gate/up tensors do: this rank's heads of q, then of k and
    v; its rows of gate, then of up."""
    from nanovllm.layers import linear

    monkeypatch.setattr(linear, "tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "tp_size", lambda: 2)
    q, k, v = torch.randn(4 * 8, 16), torch.randn(2 * 8, 16), torch.randn(2 * 8, 16)
    qb, kb, vb = torch.randn(32), torch.randn(16), torch.randn(16)
    fused, separate = (linear.QKVParallelLinear(16, 8, 4, 2, bias=True) for _ in range(2))
    fused.weight.weight_loader(fused.weight, torch.cat((q, k, v)))
    fused.bias.weight_loader(fused.bias, torch.cat((qb, kb, vb)))
    for shard, w, b in zip("qkv", (q, k, v), (qb, kb, vb)):
        separate.weight.weight_loader(separate.weight, w, shard)
        separate.bias.weight_loader(separate.bias, b, shard)
    assert torch.equal(fused.weight, separate.weight) and torch.equal(fused.bias, separate.bias)
    assert torch.equal(fused.weight[:16], q[16 * rank:16 * rank + 16])
    assert torch.equal(fused.weight[16:24], k[8 * rank:8 * rank + 8])
    gate, up = torch.randn(12, 16), torch.randn(12, 16)
    merged = linear.MergedColumnParallelLinear(16, [12, 12])
    merged.weight.weight_loader(merged.weight, torch.cat((gate, up)))
    assert torch.equal(merged.weight, torch.cat((gate[6 * rank:6 * rank + 6], up[6 * rank:6 * rank + 6])))
    with pytest.raises(ValueError, match="expected size 64 in dim 0"):
        fused.weight.weight_loader(fused.weight, torch.cat((q, k)))


def test_glm_stops_on_any_of_its_eos_ids_from_either_config(glm_dir, tmp_path):
    """GLM's three end-of-sequence ids come from generation_config.json or, without it, from
    config.json (as transformers derives its generation config)."""
    with build_llm(glm_dir) as llm:
        assert llm.config.eos_token_ids == sorted(GLM_EOS)
    for name in os.listdir(glm_dir):
        if name != "generation_config.json":
            shutil.copy(os.path.join(glm_dir, name), tmp_path / name)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == GLM_EOS
    with build_llm(str(tmp_path)) as llm:
        assert llm.config.eos_token_ids == sorted(GLM_EOS)


@pytest.mark.parametrize("shape,layer_fields", [
    ("glm-4-9b-1m", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    ("phi-3-mini-128k", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2)),
])
def test_random_checkpoint_shapes_of_the_families(shape, layer_fields, tmp_path):
    """bench_offload.py's --shape glm-4-9b-1m / phi-3-mini-128k: the real configs (here with tiny
    layers: Phi-3's 48 LongRoPE factors need its head_dim of 96) load and generate."""
    from transformers import AutoConfig

    from tools.random_checkpoint import SHAPES, make_random_checkpoint

    path = make_random_checkpoint(shape, str(tmp_path / shape), dtype=torch.float32, device="cpu", vocab_size=512,
                                  pad_token_id=0, intermediate_size=256, num_hidden_layers=1, **layer_fields)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == SHAPES[shape]["architectures"]
    assert cfg.max_position_embeddings == SHAPES[shape]["max_position_embeddings"]
    with build_llm(path, max_model_len=8192) as llm:
        out = llm.generate([random_prompt(5000, seed=980, high=512)], _greedy(), use_tqdm=False)
    assert len(out[0]["token_ids"]) == DECODE
