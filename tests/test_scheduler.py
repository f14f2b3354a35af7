"""Scheduling: preemption under a tiny KV pool, chunked prefill, max_num_seqs, step counts."""
import pytest

from nanovllm import SamplingParams
from nanovllm.engine.scheduler import longest_first
from nanovllm.sequence import Sequence

from _util import StepRecorder, build_llm, greedy, random_prompt, run_requests, token_ids

BLOCK = 256


@pytest.fixture(scope="module")
def reference_llm(llama3_dir):
    """Unconstrained engine: plenty of blocks, big token budget."""
    engine = build_llm(llama3_dir, num_kvcache_blocks=64, max_num_batched_tokens=8192)
    yield engine
    engine.shutdown()


def count_preemptions(llm, monkeypatch) -> list[int]:
    """Record the seq_id of every preempted sequence."""
    preempted = []
    original = llm.scheduler._preempt

    def preempt(seq):
        preempted.append(seq.seq_id)
        return original(seq)

    monkeypatch.setattr(llm.scheduler, "_preempt", preempt)
    return preempted


# 20 requests: prompts of 1..600 tokens, outputs that cross 256-token block boundaries.
PREEMPT_CASES = [(n, m) for n, m in zip(
    (1, 250, 600, 30, 500, 255, 7, 400, 256, 120, 511, 90, 300, 240, 60, 480, 200, 10, 700, 150),
    (20, 30, 40, 10, 30, 10, 12, 30, 20, 15, 20, 10, 30, 40, 15, 45, 60, 8, 24, 20))]


def preempt_params():
    """Greedy rows and seeded sampled rows (a seeded row's tokens must survive recomputation)."""
    params = []
    for i, (_, m) in enumerate(PREEMPT_CASES):
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1000 + i,
                                         max_tokens=m, ignore_eos=True))
        else:
            params.append(greedy(m))
    return params


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_pool(llama3_dir, reference_llm, monkeypatch):
    prompts = [random_prompt(n, seed=400 + i) for i, (n, _) in enumerate(PREEMPT_CASES)]
    params = preempt_params()
    expected = reference_llm.generate(prompts, params, use_tqdm=False)
    with build_llm(llama3_dir, num_kvcache_blocks=5, max_model_len=1024) as llm:
        preempted = count_preemptions(llm, monkeypatch)
        out = llm.generate(prompts, params, use_tqdm=False)
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == 5 and all(b.ref_count == 0 for b in bm.gpu.blocks)
        assert llm.is_finished()
    assert preempted, "the KV pool of 5 blocks should have forced at least one preemption"
    assert [len(o["token_ids"]) for o in out] == [m for _, m in PREEMPT_CASES]
    assert token_ids(out) == token_ids(expected)
    assert all(o["finish_reason"] == "length" for o in out)


def test_preemption_with_add_request_and_step(llama3_dir, reference_llm, monkeypatch):
    """Same through the step API, with a pool where two long requests cannot both grow."""
    prompts = [random_prompt(500, seed=450), random_prompt(500, seed=451), random_prompt(20, seed=452)]
    sp = greedy(40)  # 500 + 40 crosses the 512 boundary: each needs a third block
    expected = reference_llm.generate(prompts, sp, use_tqdm=False)
    with build_llm(llama3_dir, num_kvcache_blocks=5, max_model_len=1024) as llm:
        preempted = count_preemptions(llm, monkeypatch)
        results = run_requests(llm, prompts, sp)
    assert preempted
    assert [r["token_ids"] for r in results.values()] == token_ids(expected)


@pytest.mark.parametrize("budget", [256, 100])
def test_chunked_prefill_equals_unchunked(llama3_dir, reference_llm, budget):
    prompt = random_prompt(1000, seed=460)
    sp = greedy(24)  # 1000 + 24 = max_model_len
    expected = reference_llm.generate([prompt], sp, use_tqdm=False)[0]
    with build_llm(llama3_dir, max_num_batched_tokens=budget, num_kvcache_blocks=8) as llm:
        with StepRecorder(llm) as rec:
            (r,) = run_requests(llm, [prompt], sp).values()
    chunks = rec.prefill_tokens(r["seq"].seq_id)
    assert sum(chunks) == 1000 and max(chunks) <= budget
    assert len(chunks) == -(-1000 // budget)
    assert r["token_ids"] == expected["token_ids"]


def test_chunked_prefill_batch_with_decodes(llama3_dir, reference_llm):
    """Several prompts under a small budget: prefills are split and interleave with decodes."""
    prompts = [random_prompt(n, seed=470 + n) for n in (700, 30, 300, 520, 5)]
    sp = greedy(20)
    expected = reference_llm.generate(prompts, sp, use_tqdm=False)
    with build_llm(llama3_dir, max_num_batched_tokens=128, num_kvcache_blocks=16) as llm:
        with StepRecorder(llm) as rec:
            out = llm.generate(prompts, sp, use_tqdm=False)
    assert token_ids(out) == token_ids(expected)
    for is_prefill, rows in rec.steps:
        if is_prefill:
            assert sum(n for _, n in rows) <= 128


def test_max_num_seqs_is_respected(llama3_dir, reference_llm):
    prompts = [random_prompt(n, seed=480 + n) for n in (3, 50, 200, 260, 10, 90, 400, 1)]
    sp = greedy(12)
    expected = reference_llm.generate(prompts, sp, use_tqdm=False)
    with build_llm(llama3_dir, max_num_seqs=3, num_kvcache_blocks=16) as llm:
        with StepRecorder(llm) as rec:
            out = llm.generate(prompts, sp, use_tqdm=False)
            assert len(llm.scheduler.running) == 0
    assert token_ids(out) == token_ids(expected)
    assert max(len(rows) for _, rows in rec.steps) == 3


def test_prefill_has_priority_and_decode_batches_all_running(llama3_dir):
    with build_llm(llama3_dir, num_kvcache_blocks=16) as llm:
        with StepRecorder(llm) as rec:
            a = llm.add_request(random_prompt(40, seed=490), greedy(5))
            b = llm.add_request(random_prompt(60, seed=491), greedy(5))
            llm.step()
            c = llm.add_request(random_prompt(30, seed=492), greedy(5))
            llm.step()
            llm.step()
    first, second, third = rec.steps
    assert first == (True, [(a, 40), (b, 60)])
    assert second == (True, [(c, 30)])  # a new prompt is prefilled before decodes continue
    assert third[0] is False and [sid for sid, _ in third[1]] == [b, a, c]  # all running, longest context first


def test_longest_first_orders_by_context_and_keeps_ties_in_order():
    """Decode batches run longest context first (the attention kernel starts its longest programs
    first); equal lengths keep their order, so a sorted batch's order is stable step to step."""
    seqs = [Sequence(list(range(n)), SamplingParams(), BLOCK) for n in (5, 9, 5, 12, 9)]
    assert [s.seq_id for s in longest_first(seqs)] == [seqs[i].seq_id for i in (3, 1, 4, 0, 2)]
    assert longest_first([]) == []


def test_step_reports_tokens_processed(llama3_dir):
    """step() returns positive prefill token counts and -batch for decode (nano-vLLM)."""
    with build_llm(llama3_dir, num_kvcache_blocks=16) as llm:
        llm.add_request(random_prompt(40, seed=493), greedy(3))
        llm.add_request(random_prompt(60, seed=494), greedy(3))
        _, prefill_tokens = llm.step()
        _, decode_tokens = llm.step()
        while not llm.is_finished():
            llm.step()
    assert prefill_tokens == 100
    assert decode_tokens == -2


def test_finished_sequences_free_their_blocks_between_steps(llama3_dir):
    with build_llm(llama3_dir, num_kvcache_blocks=8) as llm:
        bm = llm.scheduler.block_manager
        llm.add_request(random_prompt(300, seed=495), greedy(1))
        llm.add_request(random_prompt(10, seed=496), greedy(3))
        finished, _ = llm.step()
        assert [s.num_completion_tokens for s in finished] == [1]  # max_tokens=1 ends at prefill
        assert bm.num_free_blocks == 8 - 1
        while not llm.is_finished():
            llm.step()
        assert bm.num_free_blocks == 8


def test_sequence_pickles_as_its_step_for_workers():
    """What rank 0 sends a spawned TP worker each step: the step's tokens and the fields that
    build its inputs, nothing of the history (a decode step of a long sequence stays small)."""
    import pickle

    from nanovllm.sequence import Sequence

    seq = Sequence(list(range(10, 1010)), SamplingParams(temperature=0.5), 256)
    seq.block_table, seq.host_block_table, seq.num_cached_tokens = [7, -1, 9, 4], [-1, 5, -1, -1], 256
    seq.num_computed_tokens, seq.num_scheduled_tokens = 999, 1
    view = pickle.loads(pickle.dumps(seq))
    assert len(view) == 1000 and view.last_token == 1009 and view.token_ids[999:1000] == [1009]
    assert [getattr(view, f) for f in Sequence._WORKER_FIELDS] == [getattr(seq, f) for f in Sequence._WORKER_FIELDS]
    with pytest.raises(IndexError, match="outside this step's window"):
        view.token_ids[0:10]
    assert len(pickle.dumps(seq)) < 300
    seq.num_computed_tokens, seq.num_scheduled_tokens = 256, 512  # a prefill chunk
    assert pickle.loads(pickle.dumps(seq)).token_ids[256:768] == list(range(266, 778))


@pytest.mark.parametrize("kwargs, eos, expected", [
    ({}, {0}, True),                                          # eos
    ({}, set(), False),                                       # a model without eos ids
    ({"ignore_eos": True}, {0}, False),
    ({"ignore_eos": True, "stop_token_ids": [5]}, {0}, True),
    ({"min_tokens": 2}, {0}, False),                          # ids count from the 2nd token on
    ({"min_tokens": 1}, {0}, True),
    ({"ignore_eos": True, "stop": ["x"]}, {0}, True),        # a stop string
    ({"ignore_eos": True, "stop": ["x"], "min_tokens": 1}, {0}, False),  # strings after min_tokens
])
def test_may_stop_on_token_follows_check_stop(kwargs, eos, expected):
    """Whether a prefill's first sampled token could end the sequence by its value (what the
    prefill scheduled ahead must rule out), against check_stop's rules."""
    from nanovllm.sequence import Sequence
    from nanovllm.engine.stopping import IncrementalDetokenizer, may_stop_on_token

    params = SamplingParams(max_tokens=8, **kwargs)
    seq = Sequence(list(range(10, 40)), params, 256)
    if params.stop:
        seq.detokenizer = IncrementalDetokenizer(None, params)
    assert may_stop_on_token(seq, eos) is expected
