"""The supported architectures against transformers, float32 on the CPU (GLM and Phi-3 in
more settings: tests/test_families.py).

For each tiny random checkpoint (see conftest.py): prefill logits match transformers' logits,
greedy decoding matches ``generate(do_sample=False)``, a mixed-length batch decodes exactly like
one-at-a-time requests, and tensor parallelism over gloo gives the TP=1 tokens.
"""
import json
import os
import shutil

import pytest
import torch

from _util import (ARCHS, ENGINE_DEFAULTS, VOCAB_SIZE, build_llm, greedy, random_prompt,
                   run_torchrun, token_ids)
from nanovllm import SamplingParams

LOGITS_ATOL = 1e-4
BLOCK_SIZE = 256
MIXED_LENGTHS = (1, 7, 100, 255, 256, 257, 513, 700)  # crosses the 256-token block boundaries


@pytest.fixture(scope="module", params=ARCHS)
def arch_env(request):
    """(arch, engine, transformers model) for one architecture, shared by this module's tests."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    model_dir = request.getfixturevalue(f"{arch}_dir")
    llm = build_llm(model_dir, max_model_len=2048, num_kvcache_blocks=24)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield arch, llm, hf
    llm.shutdown()


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                  eos_token_id=None, pad_token_id=3)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gen_config)
    return out[0, len(prompt):].tolist()


def test_prefill_logits_match_transformers(arch_env):
    arch, llm, hf = arch_env
    prompt = random_prompt(300, seed=11)
    ours = llm.model_runner.forward_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (300, VOCAB_SIZE)
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_ATOL, f"{arch}: max |logits - transformers| = {diff:.3g}"
    assert torch.allclose(llm.model_runner.forward_logits(prompt, last=2), ours[-2:], atol=1e-6)


def test_prefill_logits_long_prompt(arch_env):
    """Positions past the llama3 scaling's original_max_position_embeddings (1024)."""
    arch, llm, hf = arch_env
    prompt = random_prompt(1300, seed=12)
    ours = llm.model_runner.forward_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_ATOL, f"{arch}: max |logits - transformers| = {diff:.3g}"


def test_greedy_matches_transformers_generate(arch_env):
    arch, llm, hf = arch_env
    prompt = random_prompt(300, seed=13)
    out = llm.generate([prompt], greedy(32), use_tqdm=False)[0]
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 32
    assert out["token_ids"] == hf_greedy(hf, prompt, 32), arch


def test_greedy_across_block_boundary_matches_transformers(arch_env):
    """Decode that crosses a 256-token block boundary (prompt 250 + 32 tokens)."""
    arch, llm, hf = arch_env
    prompt = random_prompt(250, seed=14)
    out = llm.generate([prompt], greedy(32), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(hf, prompt, 32), arch


def test_batch_equals_one_at_a_time(arch_env):
    arch, llm, _ = arch_env
    prompts = [random_prompt(n, seed=100 + n) for n in MIXED_LENGTHS]
    batch = llm.generate(prompts, greedy(20), use_tqdm=False)
    single = [llm.generate([p], greedy(20), use_tqdm=False)[0] for p in prompts]
    assert token_ids(batch) == token_ids(single), arch
    assert all(len(o["token_ids"]) == 20 for o in batch)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.gpu.num_blocks


def test_text_prompt_and_output_text(arch_env):
    """String prompts go through the tokenizer; the output text is the decoded completion."""
    arch, llm, _ = arch_env
    text = "akpy qudfpgs yvgdpmigu quvy drqz hyre adoxq nzdwpw gyrokdxg " * 8
    out = llm.generate(text, greedy(8), use_tqdm=False)
    assert len(out) == 1
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 50 and llm.tokenizer.decode(ids) == text
    same = llm.generate([ids], greedy(8), use_tqdm=False)[0]
    assert out[0]["token_ids"] == same["token_ids"]
    assert out[0]["text"] == llm.tokenizer.decode(out[0]["token_ids"])


def test_single_token_list_prompt(arch_env):
    """generate([5, 6, 7]) is one prompt of three tokens, like generate([[5, 6, 7]])."""
    _, llm, _ = arch_env
    out = llm.generate([5, 6, 7], greedy(4), use_tqdm=False)
    assert len(out) == 1
    assert out[0]["token_ids"] == llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]["token_ids"]


def test_llama3_rope_frequencies_match_transformers(llama3_dir):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import compute_inv_freq, rope_parameters

    cfg = AutoConfig.from_pretrained(llama3_dir)
    params = rope_parameters(cfg)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    ours = compute_inv_freq(cfg.head_dim, params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    # All three bands of the scaling are exercised by this head_dim / theta.
    wavelen = 2 * torch.pi / compute_inv_freq(cfg.head_dim, {**params, "rope_type": "default"})
    assert (wavelen < 1024 / 4).any() and (wavelen > 1024).any()
    assert ((wavelen >= 1024 / 4) & (wavelen <= 1024)).any()


def test_every_layer_shares_one_rope_table(qwen3_dir):
    """One cos/sin table for the model, not one per layer (num_layers times the memory)."""
    from transformers import AutoConfig

    from nanovllm.models import get_model_class

    cfg = AutoConfig.from_pretrained(qwen3_dir)
    model = get_model_class(cfg)(cfg, 4096)
    tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in model.model.layers}
    assert cfg.num_hidden_layers > 1 and len(tables) == 1
    assert [name for name, _ in model.named_buffers()] == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]


def test_llama3_legacy_rope_scaling_config(llama3_dir, tmp_path):
    """A transformers-4 style config.json (rope_scaling + top-level rope_theta) loads the same."""
    for name in os.listdir(llama3_dir):
        shutil.copy(os.path.join(llama3_dir, name), tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompt = random_prompt(64, seed=15)
    with build_llm(llama3_dir) as a:
        ref = a.model_runner.forward_logits(prompt)
    with build_llm(str(tmp_path)) as b:
        ours = b.model_runner.forward_logits(prompt)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_unsupported_architecture_lists_supported(unsupported_dir):
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM") as info:
        build_llm(unsupported_dir)
    message = str(info.value)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                 "Phi3ForCausalLM"):
        assert arch in message


# ---- tensor parallelism ----------------------------------------------------------------

TP_ARCHS = ("llama_tied", "qwen3", "qwen2")  # GQA 3:1 tied; q/k norm; MHA head_dim 128 + bias


@pytest.mark.slow
@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tensor_parallel_2_equals_1(arch, request):
    """Gloo TP=2 gives TP=1's tokens; engines with workers come and go in one process."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts = [random_prompt(n, seed=200 + n) for n in (1, 100, 257, 600)]
    sp = greedy(16)
    with build_llm(model_dir) as tp1:
        ref = tp1.generate(prompts, sp, use_tqdm=False)
        ref_logits = tp1.model_runner.forward_logits(prompts[1])
    with build_llm(model_dir, tensor_parallel_size=2) as tp2:
        out = tp2.generate(prompts, sp, use_tqdm=False)
        assert token_ids(out) == token_ids(ref), arch
        # The repeated prompt hits the prefix cache on both ranks.
        again = tp2.generate([prompts[3]], sp, use_tqdm=False)[0]
        assert again["token_ids"] == ref[3]["token_ids"]
        with pytest.raises(RuntimeError, match="tensor_parallel_size=1"):
            tp2.model_runner.forward_logits(prompts[1])
        workers = list(tp2._workers)
        assert len(workers) == 1
    assert ref_logits.shape == (100, VOCAB_SIZE)
    assert all(not w.is_alive() for w in workers)  # shutdown joined the worker process


@pytest.mark.slow
def test_tensor_parallel_under_torchrun(llama_tied_dir, tmp_path):
    """torchrun with 2 gloo ranks (env:// rendezvous): every rank's generate returns TP=1's
    tokens, the seeded sampled request included (rank 0 samples and broadcasts), and a second
    engine in the same processes does too (the process group outlives the first)."""
    prompts = [random_prompt(n, seed=280 + n) for n in (5, 300, 520)]
    params = [dict(temperature=0.0, max_tokens=12, ignore_eos=True),
              dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, logprobs=2, repetition_penalty=1.2),
              dict(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)]
    with build_llm(llama_tied_dir) as tp1:
        ref = tp1.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
    spec = dict(model=str(llama_tied_dir), llm=ENGINE_DEFAULTS, prompts=prompts, params=params, engines=2)
    rank0, rank1 = run_torchrun(spec, tmp_path)
    assert rank0 == [token_ids(ref)] * 2
    assert rank1 == rank0
    # Rank 0 computes the logprobs and broadcasts them: every rank returns the same, TP=1's.
    logprobs = [json.loads((tmp_path / f"rank{r}_logprobs.json").read_text()) for r in (0, 1)]
    assert logprobs[0] == logprobs[1]
    sampled = [d[t].logprob for d, t in zip(ref[1].outputs[0].logprobs, ref[1]["token_ids"])]
    prompt = [d[t].logprob for d, t in zip(ref[2].prompt_logprobs[1:], prompts[2][1:])]
    for engine in logprobs[0]:
        assert engine[0] == {"sampled": None, "prompt": None}
        assert engine[1]["sampled"] == pytest.approx(sampled, abs=1e-4) and engine[1]["prompt"] is None
        assert engine[2]["prompt"] == pytest.approx(prompt, abs=1e-4) and engine[2]["sampled"] is None


@pytest.mark.slow
def test_torchrun_ranks_with_different_prompts_raise(llama_tied_dir, tmp_path):
    """Ranks that pass different prompts would silently all get rank 0's outputs (or hang in a
    mismatched collective): every rank raises instead."""
    prompts = [random_prompt(40, seed=285)]
    spec = dict(model=str(llama_tied_dir), llm=ENGINE_DEFAULTS, prompts=prompts,
                params=[dict(temperature=0.0, max_tokens=4)], rank_prompts={"1": [random_prompt(40, seed=286)]})
    for result in run_torchrun(spec, tmp_path):
        assert "arguments differ between ranks" in result["error"]


def test_tensor_parallel_size_must_match_torchrun(llama_tied_dir, monkeypatch):
    for name, value in dict(TORCHELASTIC_RUN_ID="t", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                            LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1 must equal the 2 processes"):
        build_llm(llama_tied_dir)


def test_tensor_parallel_must_divide_heads(qwen2_dir):
    # qwen2 here has 2 attention heads and 2 kv heads.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=2"):
        build_llm(qwen2_dir, tensor_parallel_size=3)


@pytest.mark.slow
def test_tensor_parallel_under_preemption_and_chunked_prefill(llama_tied_dir):
    """Workers follow rank 0 through chunked prefills, preemptions and prefix-cache hits."""
    shared = random_prompt(BLOCK_SIZE, seed=250)
    prompts = [random_prompt(n, seed=251 + n) for n in (500, 30, 260, 700)]
    prompts += [shared + random_prompt(40, seed=260), shared + random_prompt(300, seed=261)]
    sp = [greedy(m) for m in (30, 50, 20, 24, 10, 40)]
    with build_llm(llama_tied_dir, num_kvcache_blocks=32) as tp1:
        ref = tp1.generate(prompts, sp, use_tqdm=False)
    opts = dict(tensor_parallel_size=2, num_kvcache_blocks=5, max_num_batched_tokens=128)
    with build_llm(llama_tied_dir, **opts) as tp2:
        preempted = []
        original = tp2.scheduler._preempt
        tp2.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
        out = tp2.generate(prompts, sp, use_tqdm=False)
        again = tp2.generate(prompts[-2:], sp[-2:], use_tqdm=False)
    assert preempted
    assert token_ids(out) == token_ids(ref)
    assert token_ids(again) == token_ids(ref[-2:])


@pytest.mark.slow
def test_tensor_parallel_many_long_sequences(qwen3_dir):
    """400 sequences sharing one 3840-token prompt (prefix-cached, so cheap to compute) are a
    legal batch for max_num_seqs=512, max_model_len=4096; rank 0 must be able to hand every
    step to the workers (the step's description may not outgrow the rank channel)."""
    prompt = random_prompt(15 * BLOCK_SIZE, seed=270, low=300)
    opts = dict(tensor_parallel_size=2, max_model_len=4096, num_kvcache_blocks=600,
                max_num_batched_tokens=15 * BLOCK_SIZE, max_num_seqs=512)
    with build_llm(qwen3_dir, **opts) as tp2:
        out = tp2.generate([prompt] * 400, greedy(2), use_tqdm=False)
    assert len(out) == 400
    assert len({tuple(o["token_ids"]) for o in out}) == 1


def test_a_sliding_window_shorter_than_max_model_len_runs(mistral_dir):
    """A Mistral window (300 tokens) shorter than max_model_len is accepted and attended through:
    prefill logits of a prompt of 2.7 windows match transformers' (the decode paths, tiers and
    policies: tests/test_sliding_window.py)."""
    from transformers import AutoModelForCausalLM

    from nanovllm.config import Config

    assert Config(mistral_dir, max_model_len=1024, device="cpu").max_model_len == 1024
    prompt = random_prompt(800, seed=16)
    with build_llm(mistral_dir, max_model_len=1024) as llm:
        assert {spec.sliding_window for spec in llm.model_runner.cache.specs} == {300}
        ours = llm.model_runner.forward_logits(prompt)
    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_ATOL, f"max |logits - transformers| = {diff:.3g}"
