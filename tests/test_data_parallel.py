"""Data parallelism on the CPU (gloo): D replicas, spawned or under torchrun, return DP=1's
outputs in input order; the split, the statistics and bad values."""
import dataclasses
import time
from pathlib import Path

import pytest

from _util import ENGINE_DEFAULTS, StepRecorder, build_llm, greedy, random_prompt, run_torchrun, token_ids
from nanovllm import SamplingParams
from nanovllm.parallel.data_parallel import in_input_order, request_cost, split_by_cost, sum_kv_cache_stats
from nanovllm.sparse.stats import sum_sparse_stats

LENGTHS = (3, 700, 40, 300, 9, 120)  # costs that LPT splits unevenly by count, evenly by tokens
LOGPROB_TOL = 1e-5


def workload():
    """Prompts of different lengths; greedy, seeded sampling with logprobs, n=2 seeded,
    prompt logprobs, a stop string, penalties."""
    prompts = [random_prompt(n, seed=900 + n) for n in LENGTHS]
    params = [greedy(12),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, n=2, max_tokens=8, ignore_eos=True),
              greedy(4, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, repetition_penalty=1.3, top_k=50,
                             ignore_eos=True)]
    return prompts, params


def assert_same_outputs(got, ref, prefix_cached: bool = False, rank_slack: int = 0):
    """RequestOutputs equal but for request_id, logprob values within LOGPROB_TOL
    (``prefix_cached``: ``got``'s prompts were run before, so ``num_cached_tokens`` differs;
    ``rank_slack``: logprob ranks may differ by this much, for a tensor-parallel engine whose
    float32 sums run in another order, so that near-tied logits of a random model swap)."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if prefix_cached:
            g = dataclasses.replace(g, num_cached_tokens=r.num_cached_tokens)
        assert _without_logprob_values(g, rank_slack == 0) == _without_logprob_values(r, rank_slack == 0)
        for gc, rc in [(g.prompt_logprobs, r.prompt_logprobs)] + [(a.logprobs, b.logprobs)
                                                                  for a, b in zip(g.outputs, r.outputs)]:
            assert all(abs(a - b) <= rank_slack for a, b in zip(_ranks(gc), _ranks(rc)))
        for gc, rc in zip(g.outputs, r.outputs):
            assert _logprob_values(gc.logprobs) == pytest.approx(_logprob_values(rc.logprobs), abs=LOGPROB_TOL)
            if rc.cumulative_logprob is not None:
                assert gc.cumulative_logprob == pytest.approx(rc.cumulative_logprob, abs=LOGPROB_TOL)
        assert _logprob_values(g.prompt_logprobs) == pytest.approx(_logprob_values(r.prompt_logprobs),
                                                                   abs=LOGPROB_TOL)


def _logprob_values(entries):
    return [] if entries is None else [lp.logprob for d in entries if d for lp in d.values()]


def _ranks(entries):
    return [] if entries is None else [lp.rank for d in entries if d for lp in d.values()]


def _without_logprob_values(out, with_ranks: bool = True):
    def strip(entries):
        return None if entries is None else [
            None if d is None else {t: (lp.rank if with_ranks else None, lp.decoded_token) for t, lp in d.items()}
            for d in entries]

    outputs = [dataclasses.replace(c, logprobs=strip(c.logprobs), cumulative_logprob=None) for c in out.outputs]
    return dataclasses.replace(out, request_id="", outputs=outputs, prompt_logprobs=strip(out.prompt_logprobs))


@pytest.fixture(scope="module")
def dp1(llama_tied_dir):
    with build_llm(llama_tied_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(dp1):
    """DP=1's outputs for :func:`workload`."""
    return dp1.generate(*workload(), use_tqdm=False)


@pytest.fixture(scope="module")
def dp2(llama_tied_dir):
    with build_llm(llama_tied_dir, data_parallel_size=2) as llm:
        yield llm


# ---- splitting ---------------------------------------------------------------------------

def test_split_balances_tokens_and_keeps_input_order():
    costs = [5, 100, 7, 60, 40, 3, 3]
    shares = split_by_cost(costs, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    assert all(share == sorted(share) for share in shares)
    # LPT by hand: 100 -> 0; 60 -> 1; 40 -> 1 (100, 100); 7 -> 0 (tie: lowest); 5 -> 1; 3 -> 1; 3 -> 0.
    assert shares == [[1, 2, 6], [0, 3, 4, 5]]
    assert [sum(costs[i] for i in share) for share in shares] == [110, 108]
    assert split_by_cost(costs, 2) == shares, "deterministic"
    assert split_by_cost([4, 4], 3) == [[0], [1], []]
    assert split_by_cost([], 2) == [[], []]
    assert in_input_order(shares, [[f"r{i}" for i in share] for share in shares]) == [f"r{i}" for i in range(7)]


def test_request_cost_counts_prompt_and_max_tokens_per_completion():
    assert request_cost(10, SamplingParams(max_tokens=5), 100) == 15
    assert request_cost(10, SamplingParams(max_tokens=5, n=3), 100) == 45
    assert request_cost(10, SamplingParams(max_tokens=None), 100) == 100
    assert request_cost(90, SamplingParams(max_tokens=50), 100) == 100


# ---- spawned replicas --------------------------------------------------------------------

@pytest.mark.slow
def test_data_parallel_2_equals_1(dp2, reference):
    """Greedy, seeded, n=2, logprobs, prompt logprobs, stop strings: DP=2 returns DP=1's outputs
    in input order, each replica having run only its share."""
    prompts, params = workload()
    with StepRecorder(dp2) as steps:
        out = dp2.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(out, reference)
    assert len({o.request_id for o in out}) == len(out)
    costs = [request_cost(len(p), sp, ENGINE_DEFAULTS["max_model_len"]) for p, sp in zip(prompts, params)]
    local_share = split_by_cost(costs, 2)[0]
    assert 0 < len(local_share) < len(prompts)
    prefilled = sorted(sum(steps.prefill_tokens(seq_id)) for seq_id in {s for _, rows in steps.steps for s, _ in rows})
    assert prefilled == sorted(len(prompts[i]) for i in local_share for _ in range(params[i].n))


@pytest.mark.slow
def test_data_parallel_chat_and_one_prompt(dp1, dp2):
    """chat() and a batch smaller than the replicas (one replica idle) go through the split too."""
    conversation = [{"role": "user", "content": "abc def ghi"}]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    ref = dp1.chat([conversation] * 3, greedy(6), chat_template=template, use_tqdm=False)
    assert_same_outputs(dp2.chat([conversation] * 3, greedy(6), chat_template=template, use_tqdm=False), ref)
    assert_same_outputs(dp2.generate("abc", greedy(5), use_tqdm=False), dp1.generate("abc", greedy(5), use_tqdm=False))
    assert dp2.generate([], greedy(5), use_tqdm=False) == []


@pytest.mark.slow
def test_kv_cache_stats_sum_over_replicas(dp1, dp2):
    """The tiers' sizes are twice one replica's; a prompt sent twice to each replica hits its
    prefix cache as it does on DP=1 (each replica holds its own cache)."""
    prompt = random_prompt(600, seed=950)
    before = [llm.get_kv_cache_stats() for llm in (dp1, dp2)]
    for _ in range(2):
        for llm in (dp1, dp2):
            llm.generate([prompt, prompt], greedy(3), use_tqdm=False)
    after = [llm.get_kv_cache_stats() for llm in (dp1, dp2)]
    hits = [a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"] for a, b in zip(after, before)]
    assert hits[0] == hits[1] == 2 * 512, "the second call: both sequences hit two full blocks"
    assert after[1]["gpu_blocks"] == 2 * after[0]["gpu_blocks"] == 2 * ENGINE_DEFAULTS["num_kvcache_blocks"]
    assert after[1]["gpu_blocks_used"] == after[1]["host_blocks"] == 0


def test_sum_sparse_stats_adds_counts_and_recomputes_densities():
    def replica(kept, visible, loaded, available):
        return {"policy": "XATTN_BSA",
                "prefill": {"density": kept / visible, "comm_density": None, "kept_blocks": kept,
                            "visible_blocks": visible, "loaded_host_bytes": 0, "available_host_bytes": 0,
                            "per_layer": []},
                "decode": {"comm_density": loaded / available, "loaded_host_bytes": loaded,
                           "available_host_bytes": available, "read_tokens": None, "context_tokens": None,
                           "per_layer": []}}

    a, b = replica(1, 4, 3, 4), replica(5, 6, 1, 6)
    merged = sum_sparse_stats([a, b])
    assert merged["replicas"] == [a, b] and merged["policy"] == "XATTN_BSA"
    assert merged["prefill"] == {"kept_blocks": 6, "visible_blocks": 10, "loaded_host_bytes": 0,
                                 "available_host_bytes": 0, "comm_density": None, "density": 0.6}
    assert merged["decode"] == {"read_tokens": None, "context_tokens": None, "loaded_host_bytes": 4,
                                "available_host_bytes": 10, "comm_density": 0.4, "density": 1.0}
    assert sum_kv_cache_stats([{"gpu_blocks": 3, "preemptions": 1}, {"gpu_blocks": 4, "preemptions": 0}]) == \
        {"gpu_blocks": 7, "preemptions": 1}


def test_sum_sparse_stats_recomputes_the_decode_density_and_reuse_rate():
    """Replicas as SparseStats.to_dict makes them: a choosing policy's decode density and reuse rate
    come from the summed counts; a dense decode stays 1.0 with no counts."""
    from nanovllm.sparse import SparseStats

    def replica(read, context, reused, selected, dense_decode=False):
        stats = SparseStats()
        stats.add_comm(0, False, selected - reused, context)
        stats.add_reads(0, read, context)
        stats.add_reuse(0, reused, selected)
        return {"policy": "QUEST", **stats.to_dict(dense_prefill=True, dense_decode=dense_decode)}

    decode = sum_sparse_stats([replica(4, 6, 1, 2), replica(3, 12, 3, 3)])["decode"]
    assert (decode["read_tokens"], decode["context_tokens"], decode["density"]) == (7, 18, 7 / 18)
    assert (decode["reused_host_pages"], decode["read_host_pages"], decode["reuse_rate"]) == (4, 5, 0.8)
    dense = sum_sparse_stats([replica(4, 6, 0, 0, True), replica(3, 12, 0, 0, True)])["decode"]
    assert (dense["density"], dense["read_tokens"], dense["reuse_rate"]) == (1.0, None, None)


@pytest.mark.slow
def test_sparse_stats_gather_every_replica(llama_tied_dir):
    """A host tier that 700-token prompts spill to: two prompts of one cost go one to each
    replica; each replica reports what DP=1 reports for its prompt alone, the engine their sum."""
    opts = dict(enable_cpu_offload=True, num_kvcache_blocks=2, num_ring_slots=2, num_cpu_kvcache_blocks=8)
    prompts = [random_prompt(700, seed=960 + i) for i in range(2)]
    with build_llm(llama_tied_dir, **opts) as llm:
        alone = []
        for prompt in prompts:
            llm.reset_sparse_stats()
            llm.generate([prompt], greedy(6), use_tqdm=False)
            alone.append(llm.get_sparse_stats())
    with build_llm(llama_tied_dir, data_parallel_size=2, **opts) as llm:
        llm.generate(prompts, greedy(6), use_tqdm=False)
        stats = llm.get_sparse_stats()
        assert stats["decode"]["loaded_host_bytes"] > 0
        assert stats == sum_sparse_stats(alone)
        llm.reset_sparse_stats()
        assert [r["decode"]["available_host_bytes"] for r in llm.get_sparse_stats()["replicas"]] == [0, 0]


@pytest.mark.slow
def test_call_abandoned_while_replicas_run_is_not_taken_for_the_next(dp2, reference):
    """Replica 0's share fails (here: KeyboardInterrupt) while replica 1 runs its own: the next
    generate skips replica 1's late answer and returns its own outputs."""
    prompts, params = workload()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    dp2._run_requests = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            dp2.generate(prompts[::-1], params[::-1], use_tqdm=False)
    finally:
        del dp2._run_requests
    assert_same_outputs(dp2.generate(prompts, params, use_tqdm=False), reference, prefix_cached=True)


@pytest.mark.slow
def test_unseeded_requests_draw_from_each_replicas_generator(dp2):
    """One prompt twice, one copy per replica, no seed: replica 1's generator is seeded seed + 1,
    so the two samples differ (with one seed for both they would be equal)."""
    prompt = random_prompt(50, seed=970)
    outs = dp2.generate([prompt, prompt], SamplingParams(temperature=2.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert outs[0]["token_ids"] != outs[1]["token_ids"]


@pytest.mark.slow
def test_add_request_and_step_are_refused(dp2):
    for call in (lambda: dp2.add_request([5, 6, 7], greedy(2)), dp2.step):
        with pytest.raises(RuntimeError, match=r"not supported with data_parallel_size=2; use generate\(\) or chat"):
            call()
    assert len(dp2.generate([[5, 6, 7]], greedy(2), use_tqdm=False)[0]["token_ids"]) == 2


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc), but multiprocessing's resource tracker."""
    pids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in pids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_data_parallel_2_by_tensor_parallel_2(llama_tied_dir, reference):
    """DP=2 x TP=2 (replica 1 spawns its own tensor-parallel rank) returns DP=1's outputs; a
    replica that dies is a RuntimeError naming it, every later call too; shutdown stops every
    process."""
    llm = build_llm(llama_tied_dir, data_parallel_size=2, tensor_parallel_size=2)
    try:  # a failure must not leave this process's TP group to the engines of later tests
        assert_same_outputs(llm.generate(*workload(), use_tqdm=False), reference, rank_slack=2)
        replica, worker = llm._replicas.procs[0], llm._workers[0]
        (replica_rank,) = _children(replica.pid)
        replica.kill()
        replica.join()
        deadline = time.monotonic() + 30
        while _alive(replica_rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(replica_rank), "the killed replica's tensor-parallel rank exits with it"
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"data-parallel replica 1 \(pid \d+\) exited with code -9"):
                llm.generate(*workload(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not worker.is_alive()


@pytest.mark.slow
def test_spawned_replicas_without_main_guard_fail_fast(llama_tied_dir, tmp_path):
    """A spawned replica re-imports the main script; one that builds the LLM at module level dies
    at bootstrap, and replica 0 says so instead of waiting for it."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    opts = {**ENGINE_DEFAULTS, "data_parallel_size": 2}
    script.write_text(f"from nanovllm import LLM\nLLM({str(llama_tied_dir)!r}, **{opts!r})\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "data-parallel replica 1" in result.stderr and "before it was ready" in result.stderr
    assert "if __name__ == '__main__':" in result.stderr


# ---- torchrun ----------------------------------------------------------------------------

TORCHRUN_PARAMS = [dict(temperature=0.0, max_tokens=12, ignore_eos=True),
                   dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, logprobs=2),
                   dict(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
                   dict(temperature=0.8, max_tokens=6, ignore_eos=True, seed=5)]


def torchrun_reference(model_dir):
    prompts = [random_prompt(n, seed=980 + n) for n in (5, 300, 520, 60)]
    with build_llm(model_dir) as llm:
        return prompts, llm.generate(prompts, [SamplingParams(**p) for p in TORCHRUN_PARAMS], use_tqdm=False)


def check_torchrun_ranks(ranks, tmp_path, ref, num_replicas: int):
    """Every rank returned DP=1's tokens and logprobs, the same request ids and the KV cache
    stats summed over the replicas."""
    import json

    assert all(rank == [token_ids(ref)] * 2 for rank in ranks)
    logprobs = [json.loads((tmp_path / f"rank{r}_logprobs.json").read_text()) for r in range(len(ranks))]
    assert all(lp == logprobs[0] for lp in logprobs)
    sampled = [d[t].logprob for d, t in zip(ref[1].outputs[0].logprobs, ref[1]["token_ids"])]
    assert logprobs[0][0][1]["sampled"] == pytest.approx(sampled, abs=LOGPROB_TOL)
    stats = [json.loads((tmp_path / f"rank{r}_stats.json").read_text()) for r in range(len(ranks))]
    assert all(s == stats[0] for s in stats)
    for engine in stats[0]:
        assert engine["kv_cache"]["gpu_blocks"] == num_replicas * ENGINE_DEFAULTS["num_kvcache_blocks"]
        assert len(set(engine["request_ids"])) == len(ref)


@pytest.mark.slow
def test_data_parallel_under_torchrun(llama_tied_dir, tmp_path):
    """torchrun with 2 processes as DP=2 (README's launch): every rank returns DP=1's outputs,
    for two engines one after the other in the same processes."""
    prompts, ref = torchrun_reference(llama_tied_dir)
    spec = dict(model=str(llama_tied_dir), llm={**ENGINE_DEFAULTS, "data_parallel_size": 2}, prompts=prompts,
                params=TORCHRUN_PARAMS, engines=2)
    check_torchrun_ranks(run_torchrun(spec, tmp_path), tmp_path, ref, num_replicas=2)


@pytest.mark.slow
def test_data_parallel_2_by_tensor_parallel_2_under_torchrun(llama_tied_dir, tmp_path):
    """4 processes: ranks 0, 1 are replica 0's tensor-parallel group, ranks 2, 3 replica 1's."""
    prompts, ref = torchrun_reference(llama_tied_dir)
    spec = dict(model=str(llama_tied_dir), llm={**ENGINE_DEFAULTS, "data_parallel_size": 2}, prompts=prompts,
                params=TORCHRUN_PARAMS, engines=2)
    check_torchrun_ranks(run_torchrun(spec, tmp_path, nproc=4), tmp_path, ref, num_replicas=2)


@pytest.mark.slow
def test_data_parallel_torchrun_ranks_with_different_prompts_raise(llama_tied_dir, tmp_path):
    spec = dict(model=str(llama_tied_dir), llm={**ENGINE_DEFAULTS, "data_parallel_size": 2},
                prompts=[random_prompt(40, seed=990)], params=[dict(temperature=0.0, max_tokens=4)],
                rank_prompts={"1": [random_prompt(40, seed=991)]})
    for result in run_torchrun(spec, tmp_path):
        assert "arguments differ between ranks" in result["error"]


# ---- bad values --------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_data_parallel_size_must_be_a_positive_int(llama_tied_dir, value):
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        build_llm(llama_tied_dir, data_parallel_size=value)


def test_data_parallel_size_times_tp_must_match_torchrun(llama_tied_dir, monkeypatch):
    for name, value in dict(TORCHELASTIC_RUN_ID="t", RANK="0", LOCAL_RANK="0", WORLD_SIZE="3",
                            LOCAL_WORLD_SIZE="3").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=1 = 2 must equal the 3 "
                                         r"processes torchrun started \(WORLD_SIZE\)"):
        build_llm(llama_tied_dir, data_parallel_size=2)


def test_spawned_replicas_need_a_gpu_each(llama_tied_dir, monkeypatch):
    import torch

    from nanovllm.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4 ranks need as many "
                                         r"GPUs on this host, found 2"):
        Config(llama_tied_dir, device="cuda", data_parallel_size=2, tensor_parallel_size=2)
