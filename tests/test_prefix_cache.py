"""Prefix caching: full 256-token blocks are hashed, shared and reused; outputs never change."""
import pytest

import nanovllm.kvcache.block_manager as block_manager_module
from nanovllm import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.kvcache.block_manager import BlockManager

from _util import StepRecorder, build_llm, greedy, random_prompt, run_requests

BLOCK = 256


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = build_llm(qwen3_dir, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def no_cache_reference(qwen3_dir):
    """Greedy outputs from a fresh engine per prompt (nothing cached), memoized by prompt."""
    memo = {}

    def reference(prompt: list[int], max_tokens: int = 16) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            with build_llm(qwen3_dir, num_kvcache_blocks=8) as fresh:
                memo[key] = fresh.generate([prompt], greedy(max_tokens), use_tqdm=False)[0]["token_ids"]
        return memo[key]

    return reference


def assert_all_free(llm):
    bm = llm.scheduler.block_manager
    assert [b.ref_count for b in bm.gpu.blocks] == [0] * bm.gpu.num_blocks
    assert bm.num_free_blocks == bm.gpu.num_blocks
    assert llm.is_finished()


def test_repeated_600_token_prompt_reuses_two_blocks(llm, no_cache_reference):
    prompt = random_prompt(600, seed=301)
    first = run_requests(llm, [prompt], greedy(16))
    (r1,) = first.values()
    assert r1["seq"].num_cached_tokens == 0
    second = run_requests(llm, [prompt], greedy(16))
    (r2,) = second.values()
    assert r2["seq"].num_cached_tokens == 2 * BLOCK  # 600 tokens = 2 full blocks + 88
    assert r2["token_ids"] == r1["token_ids"] == no_cache_reference(prompt)
    assert_all_free(llm)


def test_cached_blocks_are_the_same_physical_blocks(llm):
    prompt = random_prompt(600, seed=302)
    sp = greedy(4)
    llm.add_request(prompt, sp)
    seq1 = llm.scheduler.waiting[-1]
    llm.step()  # prefill
    first_blocks = list(seq1.block_table)
    while not llm.is_finished():
        llm.step()
    with StepRecorder(llm) as rec:
        seq_id = llm.add_request(prompt, sp)
        seq2 = llm.scheduler.waiting[-1]
        llm.step()
        assert seq2.block_table[:2] == first_blocks[:2]
        while not llm.is_finished():
            llm.step()
    assert rec.prefill_tokens(seq_id) == [600 - 2 * BLOCK]  # only the uncached tail is computed
    assert seq2.completion_token_ids == seq1.completion_token_ids
    assert_all_free(llm)


def test_fully_cached_512_token_prompt_recomputes_last_token(llm, no_cache_reference):
    prompt = random_prompt(2 * BLOCK, seed=303)
    sp = greedy(16)
    (r1,) = run_requests(llm, [prompt], sp).values()
    with StepRecorder(llm) as rec:
        seq_id = llm.add_request(prompt, sp)
        seq = llm.scheduler.waiting[-1]
        while not llm.is_finished():
            llm.step()
    assert seq.num_cached_tokens == 2 * BLOCK
    assert rec.prefill_tokens(seq_id) == [1]  # all blocks cached: only the last token recomputed
    assert seq.completion_token_ids == r1["token_ids"] == no_cache_reference(prompt)
    assert_all_free(llm)


def test_prompts_sharing_a_prefix_share_one_block(llm, no_cache_reference):
    shared = random_prompt(BLOCK, seed=304)
    a = shared + random_prompt(100, seed=305)
    b = shared + random_prompt(300, seed=306)
    sp = greedy(16)
    llm.add_request(a, sp)
    seq_a = llm.scheduler.waiting[-1]
    llm.step()  # prefill a; its first block is now registered
    llm.add_request(b, sp)
    seq_b = llm.scheduler.waiting[-1]
    llm.step()  # prefill b (prefill has priority over a's decode)
    assert seq_b.num_cached_tokens == BLOCK
    assert seq_b.block_table[0] == seq_a.block_table[0]
    assert seq_b.block_table[1] != seq_a.block_table[1]
    bm = llm.scheduler.block_manager
    assert bm.gpu.blocks[seq_a.block_table[0]].ref_count == 2
    while not llm.is_finished():
        llm.step()
    assert seq_a.completion_token_ids == no_cache_reference(a)
    assert seq_b.completion_token_ids == no_cache_reference(b)
    assert_all_free(llm)


def test_prompt_with_repeated_block_content(llm, no_cache_reference):
    """Two identical 256-token blocks in one prompt have different hashes (the parent differs)."""
    block = random_prompt(BLOCK, seed=307)
    prompt = block + block + random_prompt(50, seed=308)
    (r1,) = run_requests(llm, [prompt], greedy(16)).values()
    (r2,) = run_requests(llm, [prompt], greedy(16)).values()
    assert r2["seq"].num_cached_tokens == 2 * BLOCK
    assert r1["token_ids"] == r2["token_ids"] == no_cache_reference(prompt)


def test_refcounts_zero_and_all_blocks_free_after_generate(llm):
    shared = random_prompt(300, seed=309)
    prompts = [shared + random_prompt(n, seed=310 + n) for n in (1, 200, 300)] + [shared]
    out = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert all(len(o["token_ids"]) == 8 for o in out)
    out2 = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o["token_ids"] for o in out2] == [o["token_ids"] for o in out]
    assert_all_free(llm)


# ---- forced hash collisions --------------------------------------------------------------

@pytest.fixture
def constant_hash(monkeypatch):
    monkeypatch.setattr(block_manager_module, "compute_block_hash", lambda token_ids, parent=-1: 12345)


def test_hash_collision_between_prompts_gives_uncached_output(constant_hash, qwen3_dir,
                                                              no_cache_reference):
    """Every block hashes the same: a different prompt must not reuse another's block."""
    a = random_prompt(600, seed=320)
    b = random_prompt(600, seed=321)
    with build_llm(qwen3_dir, num_kvcache_blocks=8) as llm:
        out_a = run_requests(llm, [a], greedy(16))
        (rb,) = run_requests(llm, [b], greedy(16)).values()
        assert rb["seq"].num_cached_tokens == 0
        (ra2,) = run_requests(llm, [a], greedy(16)).values()
    assert list(out_a.values())[0]["token_ids"] == ra2["token_ids"] == no_cache_reference(a)
    assert rb["token_ids"] == no_cache_reference(b)


def test_hash_collision_with_repeated_block_content(constant_hash, qwen3_dir, no_cache_reference):
    """Every block hashes the same and block 1 has block 0's token ids: block 1 must not be
    served by the cached block 0 (same tokens, different position and prefix)."""
    block = random_prompt(BLOCK, seed=322)
    prompt = block + block + random_prompt(50, seed=323)
    expected = no_cache_reference(prompt)
    with build_llm(qwen3_dir, num_kvcache_blocks=8) as llm:
        (r1,) = run_requests(llm, [prompt], greedy(16)).values()
        (r2,) = run_requests(llm, [prompt], greedy(16)).values()
    assert r1["token_ids"] == expected
    assert r2["token_ids"] == expected, "cached KV of the wrong block was reused"
    assert r2["seq"].num_cached_tokens == BLOCK  # block 0 is a true hit; block 1 is not


# ---- block manager unit tests ------------------------------------------------------------

def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(temperature=0.0, max_tokens=1), BLOCK)


def admit(bm: BlockManager, seq: Sequence):
    """Admit ``seq`` and give its whole prompt GPU blocks (what the scheduler does chunk by chunk)."""
    bm.allocate(seq)
    assert bm.ensure_writable(seq, len(seq) - seq.num_computed_tokens) == len(seq) - seq.num_computed_tokens


def computed(bm: BlockManager, seq: Sequence):
    """Pretend the whole sequence was prefilled, and register its full blocks."""
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def test_freed_cached_blocks_are_reused_last():
    bm = BlockManager(4, BLOCK)
    a = make_seq(random_prompt(2 * BLOCK, seed=330))
    admit(bm, a)
    a_blocks = list(a.block_table)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    # Two new uncached blocks come from the never-cached ones, not from a's.
    b = make_seq(random_prompt(2 * BLOCK, seed=331))
    admit(bm, b)
    assert not set(b.block_table) & set(a_blocks)
    # a's prefix is still fully cached.
    a_again = make_seq(a.token_ids)
    assert bm.can_allocate(a_again)
    bm.deallocate(b)  # b's blocks were never committed: they go back to the front
    c = make_seq(random_prompt(BLOCK + 1, seed=332))
    admit(bm, c)
    assert not set(c.block_table) & set(a_blocks)
    bm.deallocate(c)


def test_least_recently_freed_cached_block_is_evicted_first_and_tail_before_head():
    bm = BlockManager(4, BLOCK)
    a = make_seq(random_prompt(2 * BLOCK, seed=340))
    b = make_seq(random_prompt(2 * BLOCK, seed=341))
    for seq in (a, b):
        admit(bm, seq)
        computed(bm, seq)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.deallocate(a)
    bm.deallocate(b)
    # All 4 blocks are cached and free. A new 1-block prompt evicts a's *last* block first.
    c = make_seq(random_prompt(BLOCK, seed=342))
    admit(bm, c)
    assert c.block_table == [a_blocks[1]]
    a_again = make_seq(a.token_ids[:BLOCK] + [7])
    admit(bm, a_again)
    assert a_again.num_cached_tokens == BLOCK  # a's head block survived
    assert a_again.block_table[0] == a_blocks[0]
    assert a_again.block_table[1] == b_blocks[1]  # next evicted: b's tail, b's head survives
    bm.deallocate(c)
    bm.deallocate(a_again)
    assert bm.num_free_blocks == 4
    b_again = make_seq(b.token_ids)
    admit(bm, b_again)
    assert b_again.num_cached_tokens == BLOCK
    assert b_again.num_computed_tokens == BLOCK


def test_shared_block_refcounts():
    bm = BlockManager(6, BLOCK)
    shared = random_prompt(BLOCK, seed=350)
    a = make_seq(shared + random_prompt(10, seed=351))
    admit(bm, a)
    computed(bm, a)
    b = make_seq(shared + random_prompt(20, seed=352))
    c = make_seq(shared)
    admit(bm, b)
    admit(bm, c)
    head = bm.gpu.blocks[a.block_table[0]]
    assert b.block_table[0] == c.block_table[0] == head.block_id
    assert head.ref_count == 3
    assert c.num_cached_tokens == BLOCK and c.num_computed_tokens == BLOCK - 1
    assert bm.num_free_blocks == 6 - 3
    for seq in (a, b, c):
        bm.deallocate(seq)
    assert head.ref_count == 0
    assert bm.num_free_blocks == 6
    assert all(block.ref_count == 0 for block in bm.gpu.blocks)


def test_can_allocate_counts_free_cached_hits():
    """A cached prefix block that is free counts once: it is reused, not taken as a new block."""
    bm = BlockManager(2, BLOCK)
    a = make_seq(random_prompt(2 * BLOCK, seed=360))
    admit(bm, a)
    computed(bm, a)
    bm.deallocate(a)
    again = make_seq(a.token_ids + random_prompt(10, seed=361))  # needs 3 blocks, 2 cached
    assert not bm.can_allocate(again)
    same = make_seq(a.token_ids)
    assert bm.can_allocate(same)
    admit(bm, same)
    assert same.num_cached_tokens == 2 * BLOCK
    assert bm.num_free_blocks == 0


def test_prefix_cache_with_chunked_prefill(qwen3_dir, no_cache_reference):
    """Chunks of 100 tokens (not block aligned) register blocks as they complete; a repeated
    prompt then computes only its uncached tail, in chunks."""
    prompt = random_prompt(600, seed=370)
    other = prompt[:BLOCK] + random_prompt(400, seed=371)
    with build_llm(qwen3_dir, num_kvcache_blocks=8, max_num_batched_tokens=100) as llm:
        with StepRecorder(llm) as rec:
            (r1,) = run_requests(llm, [prompt], greedy(16)).values()
            (r2,) = run_requests(llm, [prompt], greedy(16)).values()
            (r3,) = run_requests(llm, [other], greedy(16)).values()
    assert rec.prefill_tokens(r1["seq"].seq_id) == [100] * 6
    assert rec.prefill_tokens(r2["seq"].seq_id) == [88]
    assert rec.prefill_tokens(r3["seq"].seq_id) == [100] * 4  # 656 tokens, 256 cached
    assert r1["token_ids"] == r2["token_ids"] == no_cache_reference(prompt)
    assert r3["token_ids"] == no_cache_reference(other)
