"""Bad input fails loudly with a message naming the value and the limit (ValueError for user
input, RuntimeError for resources), and leaves the engine serving everything else."""
import io
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams

from _util import VOCAB_SIZE, build_llm, greedy, random_prompt, token_ids

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def good_prompts():
    return [random_prompt(n, seed=500 + n) for n in (5, 300, 40)]


@pytest.fixture(scope="module")
def clean_outputs(qwen3_dir, good_prompts):
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=8) as fresh:
        return token_ids(fresh.generate(good_prompts, greedy(12), use_tqdm=False))


# ---- prompts -----------------------------------------------------------------------------

def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"^prompts\[0\] has 1025 tokens, more than max_model_len=1024"):
        llm.generate([random_prompt(MAX_MODEL_LEN + 1, seed=1)], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt has 1025 tokens.*max_model_len=1024"):
        llm.add_request(random_prompt(MAX_MODEL_LEN + 1, seed=1), greedy(1))
    assert llm.is_finished()


def test_long_text_prompt_is_not_truncated(llm):
    text = "akpy qudfpgs yvgdpmigu " * 400  # far more than 1024 tokens
    n = len(llm.tokenizer.encode(text))
    assert n > MAX_MODEL_LEN
    with pytest.raises(ValueError, match=rf"prompts\[0\] has {n} tokens, more than max_model_len=1024"):
        llm.generate(text, greedy(1), use_tqdm=False)


def test_prompt_of_exactly_max_model_len(llm):
    out = llm.generate([random_prompt(MAX_MODEL_LEN, seed=2)], greedy(8), use_tqdm=False)[0]
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 1  # the prompt fills max_model_len: one token, not the 8 asked


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-string", "empty-list"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty \(0 tokens\); at least 1 token"):
        llm.generate([prompt], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt is empty"):
        llm.add_request(prompt, greedy(1))
    assert llm.is_finished()


def test_empty_string_as_single_prompt(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        llm.generate("", greedy(1), use_tqdm=False)


@pytest.mark.parametrize("prompt", [None, 2.5, {"ids": [1, 2]}], ids=["none", "float", "dict"])
def test_prompt_of_the_wrong_type(llm, prompt):
    with pytest.raises(ValueError, match=r"a prompt must be a string or a list of token ids, got"):
        llm.generate([prompt], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"a prompt must be a string or a list of token ids, got"):
        llm.add_request(prompt, greedy(1))
    assert llm.is_finished()


@pytest.mark.parametrize("bad_id", [VOCAB_SIZE, VOCAB_SIZE + 100, -1])
def test_token_id_outside_vocab(llm, bad_id):
    prompt = [5, 6, bad_id, 7]
    pattern = rf"token id {bad_id} is outside the vocabulary \[0, {VOCAB_SIZE}\)"
    with pytest.raises(ValueError, match=r"^prompts\[1\]: " + pattern):
        llm.generate([[5, 6], prompt], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt: " + pattern):
        llm.add_request(prompt, greedy(1))
    assert llm.is_finished()


def test_sampling_params_count_mismatch(llm, good_prompts):
    with pytest.raises(ValueError, match=r"^sampling_params has 2 entries but prompts has 3: give one SamplingParams"):
        llm.generate(good_prompts, [greedy(1), greedy(1)], use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("value", ["no", 0, None])
def test_use_tqdm_must_be_a_bool_or_a_callable(llm, good_prompts, value):
    with pytest.raises(ValueError, match=rf"^use_tqdm must be True, False or a callable .*got {re.escape(repr(value))}"):
        llm.generate(good_prompts, greedy(1), use_tqdm=value)
    assert llm.is_finished()


def test_use_tqdm_callable_makes_the_bar(llm, good_prompts):
    """vLLM's form: a callable (tqdm's signature) makes the progress bar."""
    from functools import partial

    from tqdm import tqdm

    bars = []

    def make(**kwargs):
        bars.append(partial(tqdm, file=io.StringIO())(**kwargs))
        return bars[-1]

    llm.generate(good_prompts, greedy(1), use_tqdm=make)
    assert len(bars) == 1 and bars[0].n == bars[0].total == len(good_prompts)


# ---- sampling parameters -----------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_not_positive(value):
    with pytest.raises(ValueError, match=rf"max_tokens must be >= 1, got {value}"):
        SamplingParams(max_tokens=value)


@pytest.mark.parametrize("value", [-0.5, -1e-9, float("nan")])
def test_temperature_negative_or_nan(value):
    with pytest.raises(ValueError, match=rf"temperature must be (a finite number )?>= 0, got {value}"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1])
def test_top_p_outside_range(value):
    with pytest.raises(ValueError, match=rf"top_p must be in \(0, 1\], got {value}"):
        SamplingParams(top_p=value)


def test_top_k_below_minus_one():
    with pytest.raises(ValueError, match=r"top_k must be -1 \(disabled\) or >= 1, got -2"):
        SamplingParams(top_k=-2)
    assert SamplingParams(top_k=0).top_k == -1


# ---- engine configuration ----------------------------------------------------------------

def test_missing_model_dir(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=rf"model directory {re.escape(repr(missing))} does not exist"):
        LLM(missing, device="cpu")


def test_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(unsupported_dir):
    with pytest.raises(ValueError, match=r"unsupported architecture.*FancyNewForCausalLM.*supported: "
                                         r".*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        build_llm(unsupported_dir)


@pytest.mark.parametrize("size", [100, 0, -256, 384])
def test_kvcache_block_size_not_multiple_of_256(qwen3_dir, size):
    with pytest.raises(ValueError, match=rf"kvcache_block_size must be a positive multiple of 256, "
                                         rf"got {size}"):
        build_llm(qwen3_dir, kvcache_block_size=size)


@pytest.mark.parametrize("option, value", [("num_kvcache_blocks", -7), ("num_kvcache_blocks", 0),
                                           ("num_kvcache_blocks", 2.5), ("num_cpu_kvcache_blocks", 0)])
def test_block_counts_are_minus_one_or_positive(qwen3_dir, option, value):
    with pytest.raises(ValueError, match=rf"^{option} must be -1 \(sized automatically\) or an integer >= 1, "
                                         rf"got {value}$"):
        build_llm(qwen3_dir, enable_cpu_offload=True, **{option: value})


@pytest.mark.parametrize("value", [0, 1.5, -0.2])
def test_gpu_memory_utilization_outside_range(qwen3_dir, value):
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {value}"):
        build_llm(qwen3_dir, gpu_memory_utilization=value)


@pytest.mark.parametrize("field,value,limit", [
    ("max_num_seqs", 0, ">= 1"),
    ("max_num_batched_tokens", 0, ">= 1"),
    ("max_model_len", 0, ">= 1"),
    ("tensor_parallel_size", 0, ">= 1"),
    ("num_kvcache_blocks", 0, ">= 1"),
])
def test_integer_fields_below_minimum(qwen3_dir, field, value, limit):
    with pytest.raises(ValueError, match=rf"{field} must be.*{limit}, got {value}"):
        build_llm(qwen3_dir, **{field: value})


def test_bad_dtype_and_device(qwen3_dir):
    with pytest.raises(ValueError, match=r"dtype must be one of .*got 'int8'"):
        build_llm(qwen3_dir, dtype="int8")
    for alias, dtype in (("half", torch.float16), ("float", torch.float32)):  # vLLM's names
        with build_llm(qwen3_dir, dtype=alias) as llm:
            assert llm.config.dtype == dtype
    with pytest.raises(ValueError, match=r"device must be 'auto', 'cuda' or 'cpu', got 'tpu'"):
        build_llm(qwen3_dir, device="tpu")


def test_not_enough_kv_memory_for_one_sequence(qwen3_dir):
    with pytest.raises(RuntimeError, match=r"1 GPU \+ 0 host blocks x 256 = 256 tokens, fewer than "
                                           r"max_model_len=1024.*lower max_model_len or kvcache_block_size"):
        build_llm(qwen3_dir, num_kvcache_blocks=1, max_model_len=1024)


def test_max_model_len_is_clamped_to_the_model(qwen3_dir):
    with build_llm(qwen3_dir, max_model_len=100_000, num_kvcache_blocks=16) as llm:
        assert llm.config.max_model_len == 4096  # max_position_embeddings
        with pytest.raises(ValueError, match=r"4097 tokens, more than max_model_len=4096"):
            llm.add_request(random_prompt(4097, seed=3), greedy(1))


# ---- the engine keeps serving ------------------------------------------------------------

def test_bad_request_in_a_batch_leaves_the_others_running(llm, good_prompts, clean_outputs):
    sp = greedy(12)
    ids = [llm.add_request(p, sp) for p in good_prompts]
    with pytest.raises(ValueError, match=r"token id 999999 is outside the vocabulary"):
        llm.add_request([1, 2, 999999], sp)
    with pytest.raises(ValueError, match=r"prompt is empty"):
        llm.add_request([], sp)
    done = {}
    while not llm.is_finished():
        finished, _ = llm.step()
        done.update({s.seq_id: s.completion_token_ids for s in finished})
    assert sorted(done) == sorted(ids)
    assert [done[i] for i in ids] == clean_outputs


def test_bad_request_mid_flight(llm, good_prompts, clean_outputs):
    """A bad add_request while others are part-way through decoding."""
    sp = greedy(12)
    ids = [llm.add_request(p, sp) for p in good_prompts]
    done = {}
    for _ in range(3):
        finished, _ = llm.step()
        done.update({s.seq_id: s.completion_token_ids for s in finished})
    with pytest.raises(ValueError, match=r"1025 tokens"):
        llm.add_request(random_prompt(MAX_MODEL_LEN + 1, seed=4), sp)
    while not llm.is_finished():
        finished, _ = llm.step()
        done.update({s.seq_id: s.completion_token_ids for s in finished})
    assert [done[i] for i in ids] == clean_outputs


def test_generate_after_a_failed_generate(llm, good_prompts, clean_outputs):
    bad_batch = good_prompts[:2] + [[]]
    with pytest.raises(ValueError, match=r"prompts\[2\] is empty"):
        llm.generate(bad_batch, greedy(12), use_tqdm=False)
    assert llm.is_finished()  # nothing of the failed batch was queued
    out = llm.generate(good_prompts, greedy(12), use_tqdm=False)
    assert token_ids(out) == clean_outputs


def test_generate_after_a_step_that_raised(llm, good_prompts, clean_outputs, monkeypatch):
    """An exception in the middle of generate() (e.g. from the model) propagates; the next
    generate() still returns the right outputs."""
    calls = {"n": 0}
    real_run = llm.model_runner.run

    def flaky_run(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "run", flaky_run)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(good_prompts, greedy(12), use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate(good_prompts, greedy(12), use_tqdm=False)
    assert token_ids(out) == clean_outputs


def test_generate_that_raised_releases_its_requests(llm, good_prompts, monkeypatch):
    """A generate() interrupted mid-flight (an exception, a KeyboardInterrupt) must not leave its
    requests queued: they would hold KV blocks and be computed, unseen, by later calls."""
    calls = {"n": 0}
    real_run = llm.model_runner.run

    def interrupted_run(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "run", interrupted_run)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(good_prompts, greedy(12), use_tqdm=False)
    monkeypatch.undo()
    leftover = len(llm.scheduler.waiting) + len(llm.scheduler.running)
    bm = llm.scheduler.block_manager
    held = bm.gpu.num_blocks - bm.num_free_blocks
    while not llm.is_finished():  # clean up for the next test whatever the outcome
        llm.step()
    assert leftover == 0 and held == 0, (
        f"{leftover} requests of the failed generate() still queued, holding {held} KV blocks")


def test_all_blocks_free_after_errors(llm):
    while not llm.is_finished():  # leftovers of an aborted generate, if any
        llm.step()
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.gpu.num_blocks
    assert all(b.ref_count == 0 for b in bm.gpu.blocks)
