"""Async scheduling (``nanovllm.engine.step_loop``) gives the synchronous loop's outputs.

Two engines on the same checkpoint, ``async_scheduling`` forced on and off (on CPU the overlap
changes no timing but runs the same code path), get the same batches; their RequestOutputs
(except request ids) and KV block counts must be equal, and the async engine must have launched
decode steps ahead (a step whose input ids came from the device). Where no sequence stops on a
sampled token the steps have the same shapes and the outputs are equal to the bit. Where one
does, it is computed once more by the step after (its row is dropped), which can change that
step's padded shapes (here: CPU decode attention pads to the longest context), so logprob values
may differ by float32 summation order (within ``LOGPROB_TOL``); everything else is equal.
"""
import dataclasses
import gc
import weakref

import pytest

from nanovllm import SamplingParams
from nanovllm.config import Config, async_scheduling_blockers

from _util import LOGPROB_TOL, assert_same, build_llm, random_prompt, run_requests

ENGINE = dict(max_model_len=1024, num_kvcache_blocks=16, max_num_seqs=16)


class AheadCounter:
    """Counts the steps scheduled ahead: decode steps launched with device input ids
    (``ahead``), prefill steps launched while an earlier step was not yet postprocessed
    (``prefill_ahead``, of ``prefill`` launched)."""

    def __init__(self, llm):
        self.ahead = self.prefill = self.prefill_ahead = self.unread = 0
        run, postprocess = llm.model_runner.run, llm.scheduler.postprocess

        def counting_run(seqs, is_prefill, generators=None, spills=(), input_ids=None):
            self.ahead += input_ids is not None
            self.prefill += is_prefill
            self.prefill_ahead += is_prefill and self.unread > 0
            self.unread += 1
            return run(seqs, is_prefill, generators, spills, input_ids)

        def counting_postprocess(*args, **kwargs):
            self.unread -= 1
            return postprocess(*args, **kwargs)

        llm.model_runner.run, llm.scheduler.postprocess = counting_run, counting_postprocess


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    on, off = (build_llm(qwen3_dir, async_scheduling=flag, **ENGINE) for flag in (True, False))
    counter = AheadCounter(on)
    yield on, off, counter
    on.shutdown()
    off.shutdown()


def comparable(outputs) -> list[dict]:
    return [{k: v for k, v in dataclasses.asdict(o).items() if k not in ("request_id", "metrics")} for o in outputs]


def assert_same_generate(engines, prompts, params, stops_on_tokens: bool = False) -> list:
    on, off, counter = engines
    before = counter.ahead
    ref = off.generate(prompts, params, use_tqdm=False)
    out = on.generate(prompts, params, use_tqdm=False)
    if stops_on_tokens:
        assert_same(comparable(out), comparable(ref), LOGPROB_TOL)
    else:
        assert comparable(out) == comparable(ref)
    assert counter.ahead > before, "no decode step was scheduled ahead"
    assert_no_blocks_held(on, off)
    return ref


def assert_no_blocks_held(on, off):
    for llm in (on, off):
        bm = llm.scheduler.block_manager
        assert llm.is_finished() and bm.num_free_blocks == bm.gpu.num_blocks
    assert on.get_kv_cache_stats() == off.get_kv_cache_stats()


def stops_from(ref_tokens: list[int], text: str):
    """A stop token id and a stop string that occur mid-way in a reference completion."""
    return ref_tokens[len(ref_tokens) // 2], text[len(text) // 2:len(text) // 2 + 3]


def test_default_is_on_where_supported_and_true_is_checked(qwen3_dir):
    """None (the default) resolves to off on CPU, and on CUDA to on unless a setting blocks it
    (that branch: tests/gpu/test_async_scheduling_gpu.py); the host tier does not block it."""
    llm = build_llm(qwen3_dir)
    assert llm.config.async_scheduling is False
    llm.shutdown()
    for kwargs, blockers in (({}, []), ({"tensor_parallel_size": 2}, ["tensor_parallel_size=2"]),
                             ({"enable_cpu_offload": True}, []),
                             ({"sparse_policy": "QUEST"}, []), ({"sparse_policy": "STREAMING"}, [])):
        assert async_scheduling_blockers(Config(qwen3_dir, device="cpu", **kwargs)) == blockers
    llm = build_llm(qwen3_dir, async_scheduling=True)
    llm.generate([random_prompt(20, seed=1)], SamplingParams(max_tokens=3), use_tqdm=False)
    runner = weakref.ref(llm.model_runner)
    llm.shutdown()  # frees the model: nothing (the step loop) keeps the runner alive
    gc.collect()
    assert runner() is None
    with pytest.raises(ValueError, match="async_scheduling=True does not support tensor_parallel_size=2"):
        build_llm(qwen3_dir, async_scheduling=True, tensor_parallel_size=2)
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match=r"async_scheduling must be None \(on where supported\), True or False"):
            build_llm(qwen3_dir, async_scheduling=bad)


def test_greedy_lengths_cross_blocks(engines):
    """Different max_tokens (length stops are known ahead), decode crossing a block boundary."""
    prompts = [random_prompt(n, seed=900 + n) for n in (250, 254, 255, 40, 511)]
    assert_same_generate(engines, prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                            for m in (3, 9, 20, 1, 14)])


def test_every_sampling_feature(engines):
    """Stop strings, stop token ids, min_tokens, max_tokens, n, logprobs, prompt_logprobs,
    penalties and seeds in one batch; the stops are taken from the reference outputs, so they fire
    mid-way (a sequence stopping on its token is computed once more by the overlapped step)."""
    on, off, _ = engines
    prompts = [random_prompt(n, seed=910 + n) for n in (30, 60, 90, 120, 150, 180, 210, 240)]
    free = off.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stop_id, stop_str = stops_from(free[0]["token_ids"], free[1]["text"])
    min_stop_id, _ = stops_from(free[2]["token_ids"], free[2]["text"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str], include_stop_str_in_output=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[min_stop_id], min_tokens=13),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=18, repetition_penalty=1.4, presence_penalty=0.5,
                       frequency_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0.9, seed=7, max_tokens=22, n=3, top_k=50, top_p=0.9, logprobs=1),
        SamplingParams(temperature=1.2, seed=11, max_tokens=16, min_p=0.05, presence_penalty=1.0,
                       stop=[stop_str]),
        SamplingParams(temperature=0.0, max_tokens=20),
    ]
    ref = assert_same_generate(engines, prompts, params, stops_on_tokens=True)
    reasons = [c.finish_reason for r in ref for c in r.outputs]
    assert ref[0].outputs[0].stop_reason == stop_id and ref[1].outputs[0].stop_reason == stop_str
    assert reasons.count("length") < len(reasons)


def test_preemption(qwen3_dir):
    """A KV cache too small for the batch: sequences are preempted and recomputed (the steps
    that would preempt are not scheduled ahead)."""
    kwargs = dict(ENGINE, num_kvcache_blocks=3, max_model_len=768)
    engines = (*(build_llm(qwen3_dir, async_scheduling=f, **kwargs) for f in (True, False)),)
    counter = AheadCounter(engines[0])
    try:
        prompts = [random_prompt(n, seed=920 + n) for n in (250, 240, 230)]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 30, 40)]
        assert_same_generate((*engines, counter), prompts, params)
        assert engines[1].get_kv_cache_stats()["preemptions"] > 0
    finally:
        for llm in engines:
            llm.shutdown()


def test_prefix_cache_hits(engines):
    on, off, _ = engines
    shared = random_prompt(256, seed=930)
    prompts = [shared + random_prompt(n, seed=931 + n) for n in (5, 40, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert_same_generate(engines, prompts[:1], params)
    hits = off.get_kv_cache_stats()["prefix_cache_hit_tokens"]
    assert_same_generate(engines, prompts, params)
    assert off.get_kv_cache_stats()["prefix_cache_hit_tokens"] >= hits + 3 * 256


def test_add_request_and_step_polling(engines):
    """Requests added while others decode (the step after an addition is not scheduled ahead)."""
    on, off, counter = engines
    first = [random_prompt(n, seed=940 + n) for n in (20, 70)]
    later = [random_prompt(n, seed=950 + n) for n in (33, 260)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (15, 9)]
    results = []
    for llm in (on, off):
        ids = [llm.add_request(p, sp) for p, sp in zip(first, params)]
        done = {}
        for _ in range(4):
            done.update({s.seq_id: s for s in llm.step()[0]})
        ids += [llm.add_request(p, sp) for p, sp in zip(later, params)]
        while not llm.is_finished():
            done.update({s.seq_id: s for s in llm.step()[0]})
        results.append([(done[i].completion_token_ids, done[i].finish_reason) for i in ids])
    assert results[0] == results[1]
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=10, stop_token_ids=[results[0][0][0][5]])
    assert (list(run_requests(on, first, seeded).values())[0]["token_ids"]
            == list(run_requests(off, first, seeded).values())[0]["token_ids"])
    assert_no_blocks_held(on, off)


def test_stop_token_on_a_block_boundary(engines):
    """The stopping token is the first of a new block, so the step computing it once more places
    a block for it (freed when the stop is read): block counts stay the synchronous loop's."""
    on, off, _ = engines
    prompts = [random_prompt(240, seed=960), random_prompt(100, seed=961)]
    ref = off.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    assert ref[16] not in ref[:16]  # so the request stops on token 240 + 16 = 256
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[16]], logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    out = assert_same_generate(engines, prompts, params, stops_on_tokens=True)
    assert out[0]["token_ids"] == ref[:17] and out[0]["finish_reason"] == "stop"


def test_penalties_read_a_placeholder_token_on_the_device():
    """A generated token still on the device (a placeholder on the host) is penalised like the
    same token known on the host."""
    import torch

    from nanovllm.engine.sampling_batch import sampling_tensors
    from nanovllm.sequence import PLACEHOLDER_TOKEN, Sequence

    params = SamplingParams(temperature=0.0, presence_penalty=1.0, repetition_penalty=1.2)

    def output_pairs(last: int, input_ids=None) -> list:
        seqs = [Sequence([5, 6, 7], params, 256), Sequence([8, 9], params, 256)]
        for seq in seqs:
            seq.append_token(11)
        seqs[1].append_token(last)
        penalties = sampling_tensors(seqs, torch.device("cpu"), [2], None, 64, input_ids).penalties
        return sorted(zip(*(t.tolist() for t in penalties.output)))

    known = output_pairs(42)
    assert (1, 42) in known
    assert output_pairs(PLACEHOLDER_TOKEN, torch.tensor([13, 42])) == known


def test_blocks_placed_ahead_drop_no_cached_prefix():
    """``can_place_blank``: only free blocks without a registered prefix may be placed ahead."""
    from nanovllm.sequence import Sequence
    from nanovllm.kvcache.block_manager import BlockManager

    manager = BlockManager(num_gpu_blocks=3, block_size=256)
    seq = Sequence(random_prompt(300, seed=970), SamplingParams(), 256)
    manager.allocate(seq)
    manager.ensure_writable(seq, 300)
    seq.num_computed_tokens = 300
    manager.commit(seq)  # block 0 is full: registered
    manager.deallocate(seq)  # free: one registered block, two blank ones
    assert manager.can_place_blank(2) and not manager.can_place_blank(3)


def test_a_failed_step_ahead_releases_its_requests(engines, monkeypatch):
    """An exception while launching a step ahead (placeholders taken, blocks placed) aborts the
    generate() cleanly: no request or block is left, and the next generate() is right."""
    on, off, counter = engines
    prompts = [random_prompt(n, seed=980 + n) for n in (30, 250)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    run = on.model_runner.run

    def failing_run(seqs, is_prefill, generators=None, spills=(), input_ids=None):
        if input_ids is not None and counter.ahead > ahead_before + 2:
            raise RuntimeError("injected failure")
        return run(seqs, is_prefill, generators, spills, input_ids)

    ahead_before = counter.ahead
    monkeypatch.setattr(on.model_runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="injected failure"):
        on.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    bm = on.scheduler.block_manager
    assert on.is_finished() and bm.num_free_blocks == bm.gpu.num_blocks
    assert_same_generate(engines, prompts, params)


@pytest.fixture(scope="module")
def chunked_engines(qwen3_dir):
    """A token budget of 96, so that a batch of prompts is prefilled over many steps."""
    kwargs = dict(ENGINE, max_num_batched_tokens=96)
    on, off = (build_llm(qwen3_dir, async_scheduling=flag, **kwargs) for flag in (True, False))
    counter = AheadCounter(on)
    yield on, off, counter
    on.shutdown()
    off.shutdown()


def test_prefill_chunks_scheduled_ahead(chunked_engines):
    """No first token can stop its sequence (ignore_eos, max_tokens > 1): every prefill chunk after
    the first is launched before the one before it is read. Two prompts share a 300-token prefix,
    so the second hits the blocks the first commits while its chunks are in flight; outputs,
    block counts and prefix-cache hits are the synchronous loop's."""
    on, off, counter = chunked_engines
    shared = random_prompt(300, seed=970)
    prompts = [shared + random_prompt(20, seed=971), random_prompt(150, seed=972), shared + random_prompt(45, seed=973),
               random_prompt(70, seed=974)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 9, 4, 12)]
    hits = off.get_kv_cache_stats()["prefix_cache_hit_tokens"]
    before, launched = counter.prefill_ahead, counter.prefill
    assert_same_generate(chunked_engines, prompts, params)
    assert counter.prefill - launched >= 6
    assert counter.prefill_ahead - before == counter.prefill - launched - 1
    assert off.get_kv_cache_stats()["prefix_cache_hit_tokens"] >= hits + 256


def test_prefill_not_ahead_where_a_first_token_may_stop(chunked_engines):
    """Eos, a stop token id, a stop string or max_tokens=1 could end a sequence on the token its
    last chunk samples, which frees its blocks before the next chunk is scheduled: that chunk is
    read first. Every chunk here completes a prompt (70-90 tokens each, 96 per chunk), so none is
    launched ahead: seeded sampling with eos, a stop id, a stop string, length stops on the first
    token."""
    on, off, counter = chunked_engines
    prompts = [random_prompt(n, seed=980 + n) for n in (70, 80, 90, 85, 75)]
    for params in ([SamplingParams(temperature=0.8, seed=5, max_tokens=8)] * 5,
                   [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[7])] * 5,
                   [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=["w1 "])] * 5,
                   [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)] * 5):
        before = counter.prefill_ahead
        ref = off.generate(prompts, params, use_tqdm=False)
        assert comparable(on.generate(prompts, params, use_tqdm=False)) == comparable(ref)
        assert counter.prefill_ahead == before
        assert_no_blocks_held(on, off)


def test_host_tier_moves_are_scheduled_ahead(qwen3_dir):
    """With the host tier (async scheduling's default on CUDA now): a GPU tier of 6 blocks for
    three sequences of 1, 2 and 5 blocks that cross block boundaries while decoding, so prefill
    and decode steps spill (decode: the blocks the step in flight fills); a second round of the same prompts hits the prefix cache in both tiers (blocks
    written back, then loaded back). Steps that move blocks are scheduled ahead when no sequence
    can finish with its token (here: ignore_eos, one max_tokens), and read first otherwise (stop
    token ids); outputs, block counts, spills, write-backs and loads are the synchronous loop's."""
    kwargs = dict(ENGINE, max_model_len=2048, num_kvcache_blocks=6, enable_cpu_offload=True,
                  num_cpu_kvcache_blocks=32, num_ring_slots=2)
    on, off = (build_llm(qwen3_dir, async_scheduling=flag, **kwargs) for flag in (True, False))
    moved_ahead = []
    run = on.model_runner.run

    def counting_run(seqs, is_prefill, generators=None, moves=(), input_ids=None):
        moved_ahead.append(input_ids is not None and bool(moves))
        return run(seqs, is_prefill, generators, moves, input_ids)

    on.model_runner.run = counting_run
    try:
        prompts = [random_prompt(n, seed=990 + n) for n in (230, 480, 1200)]
        for params, exact in ((SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), True),
                              (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), True),
                              (SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11, 13]), False)):
            moved_ahead.clear()
            ref = off.generate(prompts, params, use_tqdm=False)
            out = on.generate(prompts, params, use_tqdm=False)
            if exact:
                assert comparable(out) == comparable(ref)
                assert any(moved_ahead), "no step with moves was scheduled ahead"
            else:
                assert_same(comparable(out), comparable(ref), LOGPROB_TOL)
            stats = [{k: v for k, v in llm.get_kv_cache_stats().items() if k != "host_bytes_pinned"} for llm in (on, off)]
            assert stats[0] == stats[1]
            for llm in (on, off):
                bm = llm.scheduler.block_manager
                assert llm.is_finished() and bm.num_free_blocks == bm.gpu.num_blocks + bm.host.num_blocks
        assert stats[1]["spilled_blocks"] > 0 and stats[1]["evicted_blocks"] > 0 and stats[1]["loaded_blocks"] > 0
        assert stats[1]["prefix_cache_hit_tokens"] > 0
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("policy, host", [("QUEST", False), ("QUEST", True), ("STREAMING", True)])
def test_choosing_policies_schedule_decode_ahead(qwen3_dir, policy, host):
    """A policy that chooses decode pages per KV head runs the async loop: its selection is built on
    the host from the block tables of the step scheduled ahead, its picks, page tables and reuse cache
    stay on the device. Decode selects (density < 1) and, with the host tier (a GPU tier of 6 blocks),
    gathers host pages and spills while steps run ahead; outputs, block counts and the sparse
    statistics are the synchronous loop's."""
    kwargs = dict(ENGINE, max_model_len=2048, kvcache_block_size=256, sparse_policy=policy, sparse_recent_tokens=64)
    if policy == "QUEST":
        kwargs["sparse_token_budget"] = 64
    if host:
        kwargs.update(enable_cpu_offload=True, num_kvcache_blocks=6, num_cpu_kvcache_blocks=32)
    on, off = (build_llm(qwen3_dir, async_scheduling=flag, **kwargs) for flag in (True, False))
    counter = AheadCounter(on)
    try:
        prompts = [random_prompt(n, seed=770 + n) for n in (300, 520, 900)]
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        ref = off.generate(prompts, params, use_tqdm=False)
        out = on.generate(prompts, params, use_tqdm=False)
        assert comparable(out) == comparable(ref)
        assert counter.ahead > 0, "no decode step was scheduled ahead"
        sparse = [llm.get_sparse_stats()["decode"] for llm in (on, off)]
        assert sparse[0] == sparse[1] and sparse[1]["density"] < 1
        stats = [{k: v for k, v in llm.get_kv_cache_stats().items() if k != "host_bytes_pinned"} for llm in (on, off)]
        assert stats[0] == stats[1]
        if host:
            assert stats[1]["spilled_blocks"] > 0
        for llm in (on, off):
            bm = llm.scheduler.block_manager
            assert llm.is_finished() and bm.num_free_blocks == bm.gpu.num_blocks + (bm.host.num_blocks if host else 0)
    finally:
        on.shutdown()
        off.shutdown()
