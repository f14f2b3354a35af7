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


# ---- tensor-parallel ranks that fail ----------------------------------------------------

@pytest.mark.slow
def test_failed_tp_engine_leaves_nothing_behind(llama_tied_dir, prompts):
    """A TP=2 engine that fails in setup (cache too small) stops its worker and frees its
    process group, so the next TP=2 engine in the process starts and serves."""
    with pytest.raises(RuntimeError, match="fewer than max_model_len=1024"):
        LLM(llama_tied_dir, **{**ENGINE_DEFAULTS, "num_kvcache_blocks": 1, "tensor_parallel_size": 2})
    with LLM(llama_tied_dir, **{**ENGINE_DEFAULTS, "tensor_parallel_size": 2}) as llm:
        assert len(llm.generate(prompts, greedy(4), use_tqdm=False)) == 3


@pytest.mark.slow
def test_dead_worker_is_an_error_not_a_hang(llama_tied_dir, prompts):
    llm = LLM(llama_tied_dir, **{**ENGINE_DEFAULTS, "tensor_parallel_size": 2})
    worker = llm._workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(prompts, greedy(4), use_tqdm=False)
    llm.shutdown()


@pytest.mark.slow
def test_spawned_tp_without_main_guard_fails_fast(llama_tied_dir, tmp_path):
    """Spawned ranks re-import the main script; one built at module level dies at bootstrap,
    and rank 0 says so instead of waiting for it forever."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    opts = {**ENGINE_DEFAULTS, "tensor_parallel_size": 2}
    script.write_text(f"from nanovllm import LLM\nLLM({str(llama_tied_dir)!r}, **{opts!r})\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "tensor-parallel rank 1 exited with code 1 before joining" in result.stderr
    assert "if __name__ == '__main__':" in result.stderr
