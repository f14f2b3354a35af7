"""Engines come and go in one process: shutdown, context manager, garbage collection."""
import gc

import pytest

from nanovllm import LLM

from _util import ENGINE_DEFAULTS, greedy, random_prompt, token_ids


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=700 + n) for n in (3, 150, 300)]


def test_two_engines_one_after_the_other(qwen3_dir, llama_tied_dir, prompts):
    sp = greedy(10)
    first = LLM(qwen3_dir, **ENGINE_DEFAULTS)
    out1 = first.generate(prompts, sp, use_tqdm=False)
    first.shutdown()
    first.shutdown()  # idempotent
    del first
    second = LLM(llama_tied_dir, **ENGINE_DEFAULTS)
    out2 = second.generate(prompts, sp, use_tqdm=False)
    second.shutdown()
    third = LLM(qwen3_dir, **ENGINE_DEFAULTS)
    out3 = third.generate(prompts, sp, use_tqdm=False)
    third.shutdown()
    assert all(len(o["token_ids"]) == 10 for o in out1 + out2 + out3)
    assert token_ids(out3) == token_ids(out1)  # the second engine left no trace


def test_two_engines_alive_at_once(qwen3_dir, llama3_dir, prompts):
    sp = greedy(10)
    with LLM(qwen3_dir, **ENGINE_DEFAULTS) as a, LLM(llama3_dir, **ENGINE_DEFAULTS) as b:
        ra = a.generate(prompts, sp, use_tqdm=False)
        rb = b.generate(prompts, sp, use_tqdm=False)
        ra2 = a.generate(prompts, sp, use_tqdm=False)
    assert token_ids(ra) == token_ids(ra2)
    assert token_ids(ra) != token_ids(rb)


def test_context_manager(qwen3_dir, prompts):
    with LLM(qwen3_dir, **ENGINE_DEFAULTS) as llm:
        assert isinstance(llm, LLM)
        out = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [10, 10, 10]
    llm.shutdown()  # again after __exit__: no error


def test_context_manager_shuts_down_on_exception(qwen3_dir, prompts):
    with pytest.raises(KeyError):
        with LLM(qwen3_dir, **ENGINE_DEFAULTS) as llm:
            llm.generate(prompts[:1], greedy(2), use_tqdm=False)
            raise KeyError("boom")
    with LLM(qwen3_dir, **ENGINE_DEFAULTS) as again:
        assert len(again.generate(prompts[:1], greedy(2), use_tqdm=False)[0]["token_ids"]) == 2


def test_engine_dropped_without_shutdown_is_collected(qwen3_dir, prompts):
    llm = LLM(qwen3_dir, **ENGINE_DEFAULTS)
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)
    finalizer = llm._finalizer
    del llm
    gc.collect()
    assert not finalizer.alive
    with LLM(qwen3_dir, **ENGINE_DEFAULTS) as again:
        assert len(again.generate(prompts[:1], greedy(2), use_tqdm=False)[0]["token_ids"]) == 2
