"""Sampling: greedy is exact argmax, seeds reproduce, stop conditions, top-k/top-p masking."""
import json
import math
import os
import shutil

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, _apply_top_k_top_p

from _util import EOS_ID, build_llm, greedy, random_prompt, token_ids


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = build_llm(qwen3_dir, max_model_len=1024, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def sampled(max_tokens=32, **kwargs):
    return SamplingParams(**{"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


# ---- engine-level ------------------------------------------------------------------------

def test_temperature_zero_is_argmax_of_forward_logits(llm):
    prompt = random_prompt(50, seed=600)
    out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]["token_ids"]
    for i, token in enumerate(out):
        logits = llm.model_runner.forward_logits(prompt + out[:i])[-1]
        assert token == int(logits.argmax()), f"token {i}"


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    prompts = [random_prompt(n, seed=610 + n) for n in (20, 300)]
    ref = token_ids(llm.generate(prompts, greedy(16), use_tqdm=False))
    top_k_1 = llm.generate(prompts, sampled(16, top_k=1), use_tqdm=False)
    assert token_ids(top_k_1) == ref
    tiny_p = llm.generate(prompts, sampled(16, top_p=1e-9), use_tqdm=False)
    assert token_ids(tiny_p) == ref


def test_same_seed_same_tokens_different_seed_different_tokens(llm):
    prompt = random_prompt(100, seed=620)
    a = llm.generate([prompt], sampled(32, seed=7), use_tqdm=False)[0]["token_ids"]
    b = llm.generate([prompt], sampled(32, seed=7), use_tqdm=False)[0]["token_ids"]
    c = llm.generate([prompt], sampled(32, seed=8), use_tqdm=False)[0]["token_ids"]
    g = llm.generate([prompt], greedy(32), use_tqdm=False)[0]["token_ids"]
    assert a == b
    assert a != c
    assert a != g  # temperature 1 over a 2048-token vocabulary really samples


def test_seeded_request_does_not_depend_on_its_batch(llm):
    prompt = random_prompt(100, seed=621)
    alone = llm.generate([prompt], sampled(24, seed=11), use_tqdm=False)[0]["token_ids"]
    others = [random_prompt(n, seed=622 + n) for n in (3, 260, 40)]
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [sampled(24), greedy(24), sampled(24, seed=11), sampled(24, seed=12)],
                         use_tqdm=False)
    assert batch[2]["token_ids"] == alone


def test_engine_seed_makes_unseeded_sampling_reproducible(qwen3_dir):
    """Config.seed is 'the seed of the engine's sampling generator': two engines with the same
    seed give the same unseeded samples, whatever happened to torch's global RNG."""
    prompt = random_prompt(60, seed=630)
    outs = []
    for global_seed in (123, 456):
        with build_llm(qwen3_dir, seed=0, num_kvcache_blocks=8) as engine:
            torch.manual_seed(global_seed)
            outs.append(engine.generate([prompt], sampled(24), use_tqdm=False)[0]["token_ids"])
    assert outs[0] == outs[1]


def test_mixed_batch_keeps_greedy_rows_identical(llm):
    prompts = [random_prompt(n, seed=640 + n) for n in (10, 257, 60, 500, 1)]
    all_greedy = token_ids(llm.generate(prompts, greedy(16), use_tqdm=False))
    params = [greedy(16), sampled(16), greedy(16), sampled(16, seed=3, top_k=20, top_p=0.8),
              greedy(16)]
    mixed = token_ids(llm.generate(prompts, params, use_tqdm=False))
    for i in (0, 2, 4):
        assert mixed[i] == all_greedy[i]
    assert mixed[1] != all_greedy[1] or mixed[3] != all_greedy[3]


def test_stop_token_ids_end_the_request_and_are_kept(llm):
    prompt = random_prompt(80, seed=650)
    ref = llm.generate([prompt], greedy(24), use_tqdm=False)[0]["token_ids"]
    stop = ref[5]
    k = ref.index(stop)
    out = llm.generate([prompt], greedy(24, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out["token_ids"] == ref[:k + 1]
    assert out["finish_reason"] == "stop"
    # A stop id that is never produced changes nothing.
    unused = next(t for t in range(4, 2048) if t not in ref)
    out = llm.generate([prompt], greedy(24, stop_token_ids=[unused]), use_tqdm=False)[0]
    assert out["token_ids"] == ref and out["finish_reason"] == "length"


def test_eos_from_generation_config_and_ignore_eos(llm, qwen3_dir, tmp_path):
    """generation_config.json's eos_token_id list ends requests unless ignore_eos is set."""
    prompt = random_prompt(80, seed=660)
    ref = llm.generate([prompt], greedy(24), use_tqdm=False)[0]["token_ids"]
    eos = ref[6]
    k = ref.index(eos)
    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    gen_path = tmp_path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [EOS_ID, eos]
    gen_path.write_text(json.dumps(gen))
    with build_llm(str(tmp_path), num_kvcache_blocks=8) as engine:
        assert engine.config.eos_token_ids == sorted({EOS_ID, eos})
        stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24),
                                  use_tqdm=False)[0]
        ignored = engine.generate([prompt], greedy(24), use_tqdm=False)[0]  # ignore_eos=True
    assert stopped["token_ids"] == ref[:k + 1] and stopped["finish_reason"] == "stop"
    assert ignored["token_ids"] == ref and ignored["finish_reason"] == "length"


def test_max_tokens_finish_reason_length(llm):
    out = llm.generate([random_prompt(30, seed=670)], greedy(5), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    one = llm.generate([random_prompt(30, seed=670)], greedy(1), use_tqdm=False)[0]
    assert one["token_ids"] == out["token_ids"][:1] and one["finish_reason"] == "length"


def test_max_model_len_caps_the_output(llm):
    prompt = random_prompt(1000, seed=680)
    out = llm.generate([prompt], greedy(100), use_tqdm=False)[0]
    assert len(prompt) + len(out["token_ids"]) == 1024
    assert out["finish_reason"] == "length"
    uncapped = llm.generate([prompt], greedy(24), use_tqdm=False)[0]
    assert uncapped["token_ids"] == out["token_ids"]


# ---- Sampler unit tests ------------------------------------------------------------------

def sample(logits, temperatures, top_k, top_p, generators):
    """The Sampler's tokens for rows with these parameters (no penalties, no logprobs)."""
    filters = bool(((top_k > 0) | (top_p < 1)).any())
    params = SamplingTensors(temperatures.where(temperatures > 0, 1.0), top_k if filters else None,
                             top_p if filters else None, None,
                             sampled_rows=(temperatures > 0).nonzero().squeeze(1).tolist(), generators=generators)
    return Sampler()(logits, params).tokens


def reference_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """True where a token is kept: the top_k most likely, then the smallest prefix (by descending
    probability, renormalised over the top-k) whose mass reaches top_p. One row, float64."""
    vocab = logits.numel()
    order = sorted(range(vocab), key=lambda i: -float(logits[i]))
    k = vocab if top_k in (-1, 0) else min(top_k, vocab)
    kept = order[:k]
    if top_p < 1:
        weights = [math.exp(float(logits[i]) - float(logits[kept[0]])) for i in kept]
        total = sum(weights)
        mass, nucleus = 0.0, []
        for i, w in zip(kept, weights):
            if nucleus and mass >= top_p:
                break
            nucleus.append(i)
            mass += w / total
        kept = nucleus
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[kept] = True
    return mask


@pytest.mark.parametrize("top_k,top_p", [
    (-1, 1.0), (1, 1.0), (5, 1.0), (50, 1.0), (10_000, 1.0),
    (-1, 0.5), (-1, 0.9), (-1, 0.01), (20, 0.7), (3, 0.999), (64, 0.95),
])
def test_top_k_top_p_mask_matches_reference(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 1000))
    logits = torch.randn(6, 64, generator=gen) * 2.5
    out = _apply_top_k_top_p(logits.clone(), torch.full((6,), top_k), torch.full((6,), top_p))
    for row in range(6):
        kept = ~torch.isinf(out[row])
        assert torch.equal(kept, reference_mask(logits[row], top_k, top_p)), f"row {row}"
        assert torch.equal(out[row][kept], logits[row][kept])  # kept logits are untouched


def test_top_k_top_p_mixed_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=gen) * 3
    ks, ps = [-1, 7, 30, 1], [0.6, 1.0, 0.8, 0.3]
    out = _apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    for row, (k, p) in enumerate(zip(ks, ps)):
        assert torch.equal(~torch.isinf(out[row]), reference_mask(logits[row], k, p))


def test_top_p_one_masks_nothing():
    """top_p=1 disables nucleus filtering: no token may be dropped, whatever float rounding
    does to the cumulative sum of a large vocabulary."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 32000, generator=gen) * 3
    out = _apply_top_k_top_p(logits.clone(), torch.full((16,), -1), torch.ones(16))
    dropped = torch.isinf(out).sum().item()
    assert dropped == 0, f"{dropped} tokens masked with top_p=1 and top_k disabled"


def test_sampler_greedy_rows_are_exact_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=gen)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0])
    tokens = sample(logits, temps, torch.full((5,), -1), torch.ones(5), {})
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    for row in (0, 2, 4):
        assert tokens[row] == logits[row].argmax()


def test_sampler_row_generators_reproduce():
    """A row with its own generator draws the same sequence again from the same seed, whatever
    the global RNG does; rows without one are unaffected by it."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 500, generator=gen)
    temps, top_k, top_p = torch.ones(3), torch.full((3,), -1), torch.ones(3)

    def draw(global_seed):
        torch.manual_seed(global_seed)
        row_gen = {1: torch.Generator().manual_seed(99)}
        return [int(sample(logits, temps, top_k, top_p, row_gen)[1]) for _ in range(20)]

    first, second = draw(0), draw(1)
    assert first == second
    assert len(set(first)) > 1  # the generator advances between calls


def test_sampler_distribution():
    """Frequencies over many rows follow softmax(logits / T) restricted to the kept tokens."""
    n = 40_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = base.expand(n, -1).contiguous()
    for temperature, top_k, top_p in [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.7)]:
        torch.manual_seed(5)
        tokens = sample(logits, torch.full((n,), temperature), torch.full((n,), top_k),
                        torch.full((n,), top_p), {})
        freq = torch.bincount(tokens, minlength=8).double() / n
        keep = reference_mask(base / temperature, top_k, top_p)
        expected = torch.where(keep, (base / temperature).double(), -math.inf).softmax(-1)
        assert freq[~keep].sum() == 0, (temperature, top_k, top_p)
        assert (freq - expected).abs().max() < 0.015, (temperature, top_k, top_p, freq, expected)


def test_sampling_params_fields_are_keyword_only():
    """vLLM's first field is n and nano-vLLM's temperature: a positional value is refused rather
    than read as either."""
    with pytest.raises(TypeError):
        SamplingParams(2)
    assert SamplingParams(n=2).n == 2 and SamplingParams(temperature=2).temperature == 2
