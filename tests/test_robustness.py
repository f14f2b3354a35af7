"""Robustness: wrong types, out-of-range values, a dead engine and mismatched checkpoints fail
with a ValueError / RuntimeError naming the option, the value and the limit, before anything is
queued; nothing is silently truncated; the engine keeps serving. (Found by probing the public
API; each test here failed when written, except the few marked "pin".)"""
import json
import re
import os
import shutil

import pytest

from nanovllm import SamplingParams

from _util import VOCAB_SIZE, build_llm, greedy, random_prompt, token_ids

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=900 + n) for n in (7, 60)]


def _queued(engine) -> int:
    return len(engine.scheduler.waiting) + len(engine.scheduler.running)


# ---- SamplingParams: wrong types and non-finite values are accepted silently -------------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", 1.5),              # generates 2 tokens
    ("max_tokens", float("inf")),     # runs to max_model_len
    ("max_tokens", "8"),              # bare TypeError from '<=' (None is valid: up to max_model_len)
    ("top_k", 2.5),                   # silently truncated to 2 in an int64 tensor
    ("temperature", float("inf")),    # silently uniform sampling
    ("temperature", "0.5"),           # bare TypeError from '>='
    ("stop_token_ids", "abc"),        # split into ['a', 'b', 'c'], never matches
    ("stop_token_ids", 5),            # bare TypeError: 'int' object is not iterable
    ("stop_token_ids", [1.5]),
    ("seed", 1.5),                    # accepted; generate() fails in torch manual_seed
    ("seed", 2 ** 70),                # accepted; "Overflow when unpacking long long" later
    ("bad_words_token_ids", [[]]),    # an empty sequence would match every output
    ("bad_words_token_ids", [5]),     # not a list of sequences
])
def test_sampling_params_bad_type_or_value(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*({re.escape(repr(value))}|{re.escape(str(value))})"):
        SamplingParams(**{field: value})


def test_bad_words_token_ids_negative_id_is_named():
    with pytest.raises(ValueError, match=r"bad_words_token_ids must be a list of integer token ids >= 0, got -1 in \[3, -1\]"):
        SamplingParams(bad_words_token_ids=[[3, -1]])


# ---- generate(): everything validated before anything is queued --------------------------

@pytest.mark.parametrize("bad", [None, {"temperature": 0.0}, (0.0, 4)], ids=["None", "dict", "tuple"])
def test_non_sampling_params_entry_is_rejected_before_queueing(llm, prompts, bad):
    """[good, bad] used to queue the first request, then raise AttributeError ('...has no
    attribute seed'); the orphan was later computed, unseen, by the next generate()."""
    try:
        with pytest.raises(ValueError, match=r"SamplingParams"):
            llm.generate(prompts, [greedy(4), bad], use_tqdm=False)
        assert _queued(llm) == 0, "the failed generate() left requests queued"
    finally:
        llm.scheduler.abort({s.seq_id for q in (llm.scheduler.waiting, llm.scheduler.running) for s in q})


def test_bad_seed_in_second_request_queues_nothing(llm, prompts):
    """SamplingParams(seed=2**70) currently passes; generate() then raises 'Overflow when
    unpacking long long' after queueing the first prompt."""
    try:
        with pytest.raises(ValueError, match=r"seed"):
            llm.generate(prompts, [greedy(4), SamplingParams(seed=2 ** 70, max_tokens=4)],
                         use_tqdm=False)
        assert _queued(llm) == 0, "the failed generate() left requests queued"
    finally:
        llm.scheduler.abort({s.seq_id for q in (llm.scheduler.waiting, llm.scheduler.running) for s in q})


@pytest.mark.parametrize("prompt,shown", [
    ([5, 6.5, 7], "6.5"),        # float id: silently truncated to 6
    ([5, [6], 7], "[6]"),        # ragged: bare TypeError from '<='
    ([5, "6", 7], "'6'"),        # bare TypeError
], ids=["float", "nested", "str"])
def test_non_integer_token_id(llm, prompt, shown):
    with pytest.raises(ValueError, match=r"token id"):
        llm.generate([prompt], greedy(2), use_tqdm=False)
    assert _queued(llm) == 0


def test_step_on_idle_engine_does_not_blame_the_kv_cache(llm):
    """step() with nothing queued raised 'could not schedule any sequence (KV cache too
    small)'; an idle engine should return ([], 0) or say there is nothing to run."""
    assert llm.is_finished()
    assert llm.step() == ([], 0)


def test_pin_engine_still_serves_after_the_errors(llm, prompts, qwen3_dir):
    """pin: after everything above the engine's outputs equal a fresh engine's."""
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4) as fresh:
        want = token_ids(fresh.generate(prompts, greedy(6), use_tqdm=False))
    assert token_ids(llm.generate(prompts, greedy(6), use_tqdm=False)) == want
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.gpu.num_blocks


# ---- after shutdown ------------------------------------------------------------------------

def test_use_after_shutdown_raises_a_clear_error(qwen3_dir):
    """generate/add_request raised AttributeError ("'LLM' object has no attribute
    'model_runner'"); step() blamed the KV cache."""
    engine = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)
    engine.shutdown()
    engine.shutdown()  # pin: idempotent
    with pytest.raises(RuntimeError, match=r"shut down"):
        engine.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
    with pytest.raises(RuntimeError, match=r"shut down"):
        engine.add_request([5, 6, 7], greedy(2))
    with pytest.raises(RuntimeError, match=r"shut down"):
        engine.step()


def test_pin_two_engines_at_once(qwen3_dir, prompts):
    """pin: two engines in one process are independent; shutting one down leaves the other."""
    a = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)
    b = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)
    try:
        out_b = token_ids(b.generate(prompts, greedy(4), use_tqdm=False))
        b.shutdown()
        assert token_ids(a.generate(prompts, greedy(4), use_tqdm=False)) == out_b
    finally:
        a.shutdown()
        b.shutdown()


# ---- engine options: non-integers and allocation failures ---------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 100.5),   # accepted; generate() dies: 'slice indices must be integers'
    ("num_kvcache_blocks", 2.5),         # TypeError from torch.zeros
    ("kvcache_block_size", 512.0),       # TypeError from torch.zeros
    ("max_model_len", "512"),            # bare TypeError from '>='
    ("max_model_len", float("inf")),     # logging OverflowError, then a KV-cache RuntimeError
    ("seed", 2 ** 70),                   # "Overflow when unpacking long long"
    # seed=None is vLLM's default and means 0 (tests/test_vllm_compat.py)
])
def test_engine_option_bad_type(qwen3_dir, field, value):
    with pytest.raises(ValueError, match=rf"{field}"):
        build_llm(qwen3_dir, **{"max_model_len": MAX_MODEL_LEN, "num_kvcache_blocks": 4, field: value})


@pytest.mark.parametrize("field,value", [
    (field, value) for field in ("enforce_eager", "enable_cpu_offload", "trust_remote_code", "enable_prefix_caching")
    for value in ("no", 2, None) if (field, value) != ("enable_prefix_caching", None)])
def test_engine_switch_must_be_a_bool(qwen3_dir, field, value):
    """enable_cpu_offload="no" turned the host tier on; enforce_eager="no" was taken as True.
    (enable_prefix_caching=None is vLLM's default, accepted: tests/test_vllm_compat.py.)"""
    with pytest.raises(ValueError, match=rf"{field} must be True or False, got {value!r}"):
        build_llm(qwen3_dir, **{"max_model_len": MAX_MODEL_LEN, "num_kvcache_blocks": 4, field: value})


@pytest.mark.parametrize("kwargs,shown", [
    (dict(swap_space=-1), r"swap_space=-1 asks for what nanovllm does not do: the host tier .*enable_cpu_offload"),
    (dict(block_size=16), r"block_size=16 asks for what nanovllm does not do: the KV block is kvcache_block_size"),
    (dict(max_seq_len=9),
     r"unknown engine argument\(s\) max_seq_len \(nanovllm's arguments are revision, download_dir, "
     r"tokenizer_revision, vLLM's arguments in nanovllm.vllm_compat.VLLM_ARGS and the fields of "
     r"nanovllm.config.Config: .*kvcache_block_size"),
    (dict(enable_prefix_caching=False), r"enable_prefix_caching=False is not supported"),
    (dict(num_cpu_kvcache_blocks=8), r"num_cpu_kvcache_blocks=8 sizes the host tier, which needs enable_cpu_offload"),
    (dict(eos_token_ids=[5]), r"unknown engine argument\(s\) eos_token_ids \(nanovllm's arguments are revision"),
])
def test_engine_arguments_nanovllm_does_not_take(qwen3_dir, kwargs, shown):
    """vLLM arguments raised a bare TypeError from Config; a host-tier size without the tier was ignored."""
    with pytest.raises(ValueError, match=shown) as error:
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, **kwargs)
    assert "num_gpu_blocks," not in str(error.value)  # deprecated names are not offered


def test_vllm_tokenizer_arguments(qwen3_dir, tmp_path):
    """tokenizer= loads the tokenizer from another directory; trust_remote_code and
    enable_prefix_caching=True are accepted as in vLLM."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(qwen3_dir, tok_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, tokenizer=str(tok_dir), trust_remote_code=True,
                   enable_prefix_caching=True) as llm:
        assert llm.get_tokenizer().name_or_path == str(tok_dir)
        assert llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(ValueError, match=r"cannot load a tokenizer from "):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, tokenizer=str(tmp_path))


def test_offload_num_ring_slots_not_integer(qwen3_dir):
    """TypeError from torch.Size in the host tier."""
    with pytest.raises(ValueError, match=r"num_ring_slots.*2\.5"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_ring_slots=2.5)


def test_num_ring_slots_without_the_host_tier_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match=r"num_ring_slots=8 sizes the host tier's ring.*enable_cpu_offload=True"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_ring_slots=8)


def test_deprecated_num_gpu_blocks_still_sets_the_ring_slots(qwen3_dir):
    with pytest.warns(DeprecationWarning, match="num_gpu_blocks is deprecated.*num_ring_slots"):
        llm = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_gpu_blocks=3,
                        num_cpu_kvcache_blocks=4)
    assert llm.config.num_ring_slots == 3 and llm.config.num_gpu_blocks is None
    llm.shutdown()
    with pytest.raises(ValueError, match=r"num_gpu_blocks must be >= 2, got 1"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_gpu_blocks=1)


def test_huge_num_kvcache_blocks_names_the_option(qwen3_dir):
    """Raw torch 'DefaultCPUAllocator: can't allocate memory' with no option named (offload mode
    already says 'cannot allocate host KV cache of N GiB')."""
    with pytest.raises(RuntimeError, match=r"num_kvcache_blocks.*1000000000"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=10 ** 9)


def test_pin_offload_one_slot_and_tiny_tiers(qwen3_dir):
    """pin: host-tier limits are checked with clear messages."""
    with pytest.raises(ValueError, match=r"num_ring_slots must be >= 2, got 1"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_ring_slots=1)
    with pytest.raises(RuntimeError, match=r"1 GPU \+ 0 host blocks x 256 = 256 tokens.*max_model_len=512.*"
                                          r"set num_kvcache_blocks \(on cpu the cache takes at most 0.25"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_kvcache_blocks=1,
                  num_cpu_kvcache_blocks=-1, cpu_memory_utilization=1e-12)
    with pytest.raises(ValueError, match=r"num_kvcache_blocks must be >= 2 with enable_cpu_offload=True.*got 1"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True, num_kvcache_blocks=1,
                  num_cpu_kvcache_blocks=4)


# ---- checkpoints that do not match their config ----------------------------------------------

def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("vocab", [VOCAB_SIZE // 2, VOCAB_SIZE * 2])
def test_vocab_size_mismatch_is_not_silently_truncated(qwen3_dir, tmp_path, vocab):
    """config vocab_size != the checkpoint's embedding rows: the embedding / lm_head loaders
    slice or zero-pad and the engine loads and generates as if nothing were wrong."""
    bad = _copy_with_config(qwen3_dir, tmp_path / "model", vocab_size=vocab)
    with pytest.raises(RuntimeError, match=rf"(embed_tokens|lm_head).*{VOCAB_SIZE}.*{vocab}|"
                                           rf"(embed_tokens|lm_head).*{vocab}.*{VOCAB_SIZE}"):
        build_llm(bad, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)


def test_hidden_size_mismatch_names_the_tensor(qwen3_dir, tmp_path):
    """Raised 'The size of tensor a (256) must match the size of tensor b (128) at non-singleton
    dimension 1' from embed_head.py, naming neither the tensor nor the file."""
    bad = _copy_with_config(qwen3_dir, tmp_path / "model", hidden_size=256)
    with pytest.raises(RuntimeError, match=r"(embed_tokens|lm_head|proj|norm).*(256.*128|128.*256)"):
        build_llm(bad, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)


def test_truncated_safetensors_names_the_file(qwen3_dir, tmp_path):
    """A truncated weights file raised safetensors' SafetensorError ('invalid header length')."""
    bad = _copy_with_config(qwen3_dir, tmp_path / "model")
    weights = [f for f in os.listdir(bad) if f.endswith(".safetensors")][0]
    with open(os.path.join(bad, weights), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(RuntimeError, match=rf"{weights}"):
        build_llm(bad, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4)
