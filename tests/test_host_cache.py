"""The host tier as a second-level prefix cache, and its memory pinned on demand (CPU, float32).

A freed, registered GPU block about to be reused is written back to the host tier and stays
registered there; a later hit reads it from the host or loads it back to the GPU tier. Outputs
never change; block counts return to their starting values; host memory is pinned in chunks as
blocks are used (on CPU the same bookkeeping runs with nothing pinned).
"""
import mmap

import pytest

from _util import build_llm, greedy, prefill, random_prompt
from nanovllm.kvcache import host_memory
from nanovllm.kvcache.block_manager import BlockManager, compute_block_hash
from nanovllm.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BLOCK = 256
HOST = dict(enable_cpu_offload=True, num_cpu_kvcache_blocks=64, num_ring_slots=3)


def _assert_nothing_held(llm):
    stats = llm.get_kv_cache_stats()
    assert stats["gpu_blocks_used"] == stats["host_blocks_used"] == 0, stats
    assert llm.scheduler.block_manager.num_free_blocks == stats["gpu_blocks"] + stats["host_blocks"]


def _block_hashes(tokens: list[int]) -> list[int]:
    hashes, h = [], -1
    for i in range(len(tokens) // BLOCK):
        h = compute_block_hash(tokens[i * BLOCK:(i + 1) * BLOCK], h)
        hashes.append(h)
    return hashes


# ---------------------------------------------------------------- the engine
def test_repeated_prompt_after_other_traffic_hits_the_host_tier(llama3_dir):
    """The issue's case: GPU tier 8 x 256-token blocks, a 3,000-token prompt, four other prompts
    that take every GPU block (so every block of the first prompt, its first block included, left
    the GPU tier), then the first prompt again: 11 full blocks (2,816 tokens) found on the host,
    the same tokens as the first time and as a GPU-only engine."""
    first = random_prompt(3000, seed=501)
    others = [random_prompt(n, seed=502 + n) for n in (2100, 2300, 1900, 2500)]
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=8, **HOST) as llm:
        start = llm.get_kv_cache_stats()
        out1 = llm.generate([first], greedy(16), use_tqdm=False)[0]
        _assert_nothing_held(llm)
        for prompt in others:
            llm.generate([prompt], greedy(4), use_tqdm=False)
            _assert_nothing_held(llm)
        index = llm.scheduler.block_manager.index
        tiers = [index[h].tier for h in _block_hashes(first)]
        assert tiers == ["host"] * 11, "every full block of the first prompt, its first included, is on the host"
        stats = llm.get_kv_cache_stats()
        assert stats["evicted_blocks"] > 0 and stats["host_bytes_pinned"] > 0, stats
        out2 = llm.generate([first], greedy(16), use_tqdm=False)[0]
        assert out2["num_cached_tokens"] >= 2816
        assert out2["token_ids"] == out1["token_ids"]
        _assert_nothing_held(llm)
        end = llm.get_kv_cache_stats()
        assert (end["gpu_blocks_used"], end["host_blocks_used"]) == (start["gpu_blocks_used"], start["host_blocks_used"])
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=64) as ref:
        assert ref.generate([first], greedy(16), use_tqdm=False)[0]["token_ids"] == out1["token_ids"]
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=13) as gpu_only:  # no host tier: recomputed
        gpu_only.generate([first], greedy(4), use_tqdm=False)
        for prompt in others:
            gpu_only.generate([prompt], greedy(4), use_tqdm=False)
        assert gpu_only.generate([first], greedy(4), use_tqdm=False)[0]["num_cached_tokens"] == 0


def test_pinned_bytes_grow_with_use_and_are_released(llama3_dir, monkeypatch):
    """Chunks of one block: the host tier's capacity is 64 blocks, but only the chunks its blocks
    reached are pinned (one ahead), reported by ``host_bytes_pinned``; shutdown unpins them."""
    monkeypatch.setattr(host_memory, "PIN_CHUNK_BYTES", 0)  # one block per chunk
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=8, **HOST) as llm:
        memory = llm.model_runner.cache.host.memory
        assert memory.chunk_blocks == 1 and memory.capacity_bytes >= 64 * 2 * memory.num_layers * memory.block_bytes
        llm.generate([random_prompt(3000, seed=510)], greedy(4), use_tqdm=False)
        used = 1 + max(i for i, b in enumerate(llm.scheduler.block_manager.host.blocks) if b.hash != -1)
        memory.ensure(used)
        pinned = llm.get_kv_cache_stats()["host_bytes_pinned"]
        assert 0 < pinned < memory.capacity_bytes
        assert memory.pinned_blocks >= used
    assert memory.bytes_pinned == 0, "released at shutdown"


def test_first_chunk_is_pinned_at_build(llama3_dir, monkeypatch):
    """The first spill writes into the host tier's first chunk: it is pinned when the engine is
    built (with the background thread idle here), so no step waits for it."""
    monkeypatch.setattr(host_memory.HostMemory, "_run", lambda self: None)  # the thread pins nothing
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=8, **HOST) as llm:
        memory = llm.model_runner.cache.host.memory
        assert memory.pinned_blocks == min(memory.chunk_blocks, memory.num_blocks) >= 16
        llm.generate([random_prompt(2600, seed=511)], greedy(2), use_tqdm=False)  # 11 blocks: spills into chunk 0
        assert llm.get_kv_cache_stats()["spilled_blocks"] > 0 and memory.num_waits == 0


# ---------------------------------------------------------------- block manager, unit level
def _seq(tokens):
    return Sequence(tokens, SamplingParams(temperature=0.0), BLOCK)


def test_a_reused_registered_gpu_block_is_written_back_and_hit_on_the_host():
    bm = BlockManager(4, BLOCK, num_host_blocks=8)
    a = _seq(random_prompt(3 * BLOCK, seed=520))
    prefill(bm, a)
    a_gpu = list(a.block_table)
    bm.deallocate(a)
    assert bm.take_moves() == []
    b = _seq(random_prompt(4 * BLOCK - 10, seed=521))
    prefill(bm, b)
    moves = bm.take_moves()
    assert [m.gpu for m in moves] == a_gpu[::-1] and all(m.to_host for m in moves), "a's tail first (freed first)"
    assert [bm.index[h].tier for h in _block_hashes(a.token_ids)] == ["host"] * 3
    assert bm.usage()["evicted_blocks"] == 3 and bm.usage()["spilled_blocks"] == 0
    assert bm.num_free_blocks == 12 - 4
    bm.deallocate(b)
    again = _seq(a.token_ids + [7])
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_cached_tokens == 3 * BLOCK
    loads = [m for m in bm.take_moves() if not m.to_host]
    assert len(loads) == 3, "hits loaded back (the GPU tier has room)"
    assert again.block_table[0] != -1, "the first block is on the GPU again"
    assert [m.gpu for m in loads] == [g for g in again.block_table[:len(loads)]]
    bm.deallocate(again)
    assert bm.num_free_blocks == 12


def test_write_backs_ahead_of_reuse_move_nothing_when_the_blocks_are_reused():
    """With ``write_ahead_blocks``, the moves taken after a sequence freed its registered blocks
    write the next ones the GPU tier reuses back ahead (``ahead`` moves into blank host blocks);
    reusing them later hands the registration over with no copy, and a later prompt hits them."""
    bm = BlockManager(4, BLOCK, num_host_blocks=8, write_ahead_blocks=3)
    a = _seq(random_prompt(3 * BLOCK, seed=560))
    prefill(bm, a)
    a_gpu = list(a.block_table)
    bm.deallocate(a)
    ahead = bm.take_moves()
    assert all(m.to_host and m.ahead for m in ahead)
    assert [m.gpu for m in ahead] == a_gpu[::-1][:2], "among the next three the GPU tier reuses: its blank one, a's two last"
    assert all(bm.index[h].tier == "gpu" for h in _block_hashes(a.token_ids)), "still registered on the GPU"
    assert bm.take_moves() == [], "written ahead once"
    b = _seq(random_prompt(4 * BLOCK - 10, seed=561))
    prefill(bm, b)
    moves = bm.take_moves()
    assert [(m.gpu, m.ahead) for m in moves] == [(a_gpu[0], False)], "only the block not written ahead is copied"
    assert [bm.index[h].tier for h in _block_hashes(a.token_ids)] == ["host"] * 3
    assert bm.usage()["evicted_blocks"] == 3
    bm.deallocate(b)
    again = _seq(a.token_ids + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 3 * BLOCK
    bm.deallocate(again)
    assert bm.num_free_blocks == 12


def test_nothing_is_written_ahead_while_blank_gpu_blocks_come_first():
    bm = BlockManager(8, BLOCK, num_host_blocks=8, write_ahead_blocks=4)
    a = _seq(random_prompt(3 * BLOCK, seed=580))
    prefill(bm, a)
    bm.deallocate(a)
    assert bm.take_moves() == [], "the next four reused are blank: a's blocks are not written"


def test_writes_ahead_take_only_host_blocks_that_are_ready():
    """Write-backs ahead of reuse use only the host blocks below ``host_blocks_ready()`` (the
    pinned ones), so that no step waits for pinning because of them; more follow as more are ready."""
    ready = [1]
    bm = BlockManager(4, BLOCK, num_host_blocks=8, write_ahead_blocks=4, host_blocks_ready=lambda: ready[0])
    a = _seq(random_prompt(3 * BLOCK, seed=590))
    prefill(bm, a)
    bm.deallocate(a)
    first = bm.take_moves()
    assert [(m.host, m.ahead) for m in first] == [(0, True)], "one host block ready: one block written ahead"
    ready[0] = 8
    rest = bm.take_moves()
    assert len(rest) == 2 and all(m.ahead and m.host > 0 for m in rest), "the others once host blocks are ready"
    assert bm.take_moves() == []


def test_writes_ahead_take_only_blank_host_blocks():
    """A write-back ahead of reuse never drops a cached prefix from the host tier."""
    bm = BlockManager(4, BLOCK, num_host_blocks=1, write_ahead_blocks=4)
    a = _seq(random_prompt(3 * BLOCK, seed=570))
    prefill(bm, a)
    bm.deallocate(a)
    assert len(bm.take_moves()) == 1, "one blank host block: one block written ahead"
    b = _seq(random_prompt(2 * BLOCK, seed=571))
    prefill(bm, b)
    bm.deallocate(b)
    assert all(not m.ahead for m in bm.take_moves()), "no blank host block left"


def test_loaded_back_blocks_keep_their_host_copy():
    """A loaded-back block spills and is written back again without a copy."""
    bm = BlockManager(4, BLOCK, num_host_blocks=8)
    a = _seq(random_prompt(2 * BLOCK, seed=530))
    prefill(bm, a)
    bm.deallocate(a)
    filler = _seq(random_prompt(4 * BLOCK, seed=531))
    prefill(bm, filler)  # writes a's two blocks back
    bm.deallocate(filler)
    bm.take_moves()
    again = _seq(a.token_ids + [5] * 3)
    bm.allocate(again)
    assert sum(not m.to_host for m in bm.take_moves()) == 2
    block = bm.gpu.blocks[again.block_table[1]]
    assert block.copy is not None and block.copy.tier == "host"
    host_id = block.copy.block_id
    bm.placement.add(again.block_table[1], 1)
    assert bm.tiers.spill_coldest()
    assert bm.take_moves() == [], "spilled onto its host copy"
    assert again.host_block_table[1] == host_id
    bm.deallocate(again)
    assert bm.num_free_blocks == 12


def test_write_backs_drop_the_coldest_free_host_entries_never_a_live_block():
    bm = BlockManager(4, BLOCK, num_host_blocks=2)
    live = _seq(random_prompt(2 * BLOCK + 5, seed=540))
    prefill(bm, live)
    bm.placement.add(live.block_table[1], 1)
    assert bm.tiers.spill_coldest()  # live block 1 on the host: host tier 1 free block
    bm.take_moves()
    a = _seq(random_prompt(BLOCK, seed=541))
    prefill(bm, a)
    bm.deallocate(a)
    b = _seq(random_prompt(BLOCK, seed=542))
    prefill(bm, b)
    bm.deallocate(b)
    big = _seq(random_prompt(2 * BLOCK, seed=543))  # takes a's and b's free GPU blocks
    bm.allocate(big)
    bm.ensure_writable(big, 2 * BLOCK)
    moves = bm.take_moves()
    assert len(moves) == 2 and all(m.to_host for m in moves) and moves[0].host == moves[1].host
    (a_hash,), (b_hash,) = _block_hashes(a.token_ids), _block_hashes(b.token_ids)
    assert a_hash not in bm.index, "the colder write-back was dropped for the newer one"
    assert bm.index[b_hash].tier == "host"
    assert bm.host.blocks[live.host_block_table[1]].ref_count == 1, "the live block stayed"


# ---------------------------------------------------------------- host memory, unit level
@pytest.mark.parametrize("block_shape", [(256, 2, 32), (16, 3, 8), (3, 5, 7)], ids=["page-multiple", "part-page", "odd"])
def test_chunk_ranges_tile_the_mapping_and_each_holds_whole_blocks(block_shape):
    """Chunks start on a page (a multiple of PAGESIZE / gcd(block_bytes, PAGESIZE) blocks), their
    ranges tile the mapping, and every layer of every block lies inside one range of its chunk:
    one registration per copy (a copy spanning two crashes CUDA)."""
    import math

    import torch

    memory = host_memory.HostMemory(3, 40, block_shape, torch.float32, torch.device("cpu"), chunk_bytes=1)
    assert memory.chunk_blocks == min(40, mmap.PAGESIZE // math.gcd(memory.block_bytes, mmap.PAGESIZE))
    assert not memory.one_allocation, "on demand: copies go a layer at a time"
    ranges = [memory.chunk_ranges(c) for c in range(memory.num_chunks)]
    flat = sorted(r for chunk in ranges for r in chunk)
    assert all(a % mmap.PAGESIZE == 0 for a, _ in flat)
    assert all(a + n <= b for (a, n), (b, _) in zip(flat, flat[1:])), "no overlap"
    assert sum(n for _, n in flat) == memory.kv_bytes == memory.capacity_bytes, "the whole mapping"
    for c, chunk in enumerate(ranges):
        for b in range(c * memory.chunk_blocks, min((c + 1) * memory.chunk_blocks, 40)):
            for t in (memory.k, memory.v):
                for layer in range(3):
                    start = t[layer, b].data_ptr()
                    end = start + memory.block_bytes
                    assert sum(a <= start and end <= a + n for a, n in chunk) == 1, (c, b, layer)
    memory.start()
    memory.ensure(40)
    assert memory.pinned_blocks == 40 and memory.bytes_pinned == memory.capacity_bytes
    memory.release()
    assert memory.bytes_pinned == 0


def test_a_waiting_step_ends_the_pinning_threads_pause(monkeypatch):
    """After each registration beyond a chunk ahead of use the thread pauses (PIN_DUTY) so that a
    step's launches rarely queue behind the driver; a step waiting in ensure() moves the blocks in
    use past the pinned ones, which ends the pause, and the thread pins on without one. Here a
    pause would last ~10^4 s."""
    import threading
    import time

    import torch

    monkeypatch.setattr(host_memory, "PIN_DUTY", 1e-6)
    memory = host_memory.HostMemory(2, 12, (16, 2, 8), torch.float32, torch.device("cpu"), chunk_bytes=1)
    registered = []

    def register(address, size):
        time.sleep(0.01)
        registered.append(address)

    monkeypatch.setattr(memory, "_register", register)
    assert memory.num_chunks >= 3
    memory.ahead_blocks = 3 * memory.chunk_blocks
    memory.start()  # nothing in use, chunks 0-2 asked for
    deadline = time.monotonic() + 30
    while len(registered) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(registered) == 2 * 2 + 1, ("chunk 0 (keys and values of 2 layers) without a pause (less than a "
                                          "chunk beyond use), then a pause after chunk 1's first registration")
    waiter = threading.Thread(target=memory.ensure, args=(memory.num_blocks,))
    waiter.start()
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "a waiting step ended the pause"
    assert memory.pinned_blocks == memory.num_blocks and memory.num_waits == 1
    assert len(registered) == 2 * 2 * memory.num_chunks, "keys and values of each layer, every chunk"
    memory.ensure(memory.num_blocks)  # all pinned: no wait
    assert memory.num_waits == 1
    memory.release()


def test_a_wait_doubles_how_far_ahead_the_thread_pins(monkeypatch):
    """The thread pins one chunk beyond the blocks written; a step that had to wait doubles that
    (use outran the thread), so the thread goes on to pin further ahead, and no further."""
    import time

    import torch

    memory = host_memory.HostMemory(2, 40, (16, 2, 8), torch.float32, torch.device("cpu"), chunk_bytes=1)
    monkeypatch.setattr(memory, "_register", lambda address, size: time.sleep(0.01))
    chunk = memory.chunk_blocks
    assert memory.num_chunks >= 6 and memory.ahead_blocks == chunk
    memory.start()  # asks for the chunk through block `chunk`
    memory.ensure(2 * chunk + 1)  # beyond what was asked for: waits
    assert memory.num_waits == 1 and memory.ahead_blocks == 2 * chunk
    want = -(-(2 * chunk + 1 + 2 * chunk) // chunk) * chunk
    deadline = time.monotonic() + 30
    while memory.pinned_blocks < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert memory.pinned_blocks == want, (memory.pinned_blocks, want)
    memory.ensure(want)  # pinned already: no wait, no doubling
    assert memory.num_waits == 1 and memory.ahead_blocks == 2 * chunk
    memory.release()


def test_the_thread_does_not_pause_while_less_than_a_chunk_ahead_of_use(monkeypatch):
    """Blocks reserved (about to be written): the thread pins every chunk up to a chunk beyond them
    without pausing, although no step waits, then pauses before pinning further ahead (a pause:
    ~10^4 s)."""
    import time

    import torch

    monkeypatch.setattr(host_memory, "PIN_DUTY", 1e-6)
    memory = host_memory.HostMemory(2, 40, (16, 2, 8), torch.float32, torch.device("cpu"), chunk_bytes=1)
    monkeypatch.setattr(memory, "_register", lambda address, size: time.sleep(0.001))
    chunk = memory.chunk_blocks
    assert memory.num_chunks >= 8
    memory.ahead_blocks = 3 * chunk  # asks for chunks 0-6: those past chunk 4 are paced
    memory.start()
    memory.reserve(4 * chunk)
    deadline = time.monotonic() + 30
    while memory.pinned_blocks < 5 * chunk and time.monotonic() < deadline:
        time.sleep(0.01)
    assert memory.pinned_blocks >= 5 * chunk and memory.num_waits == 0
    time.sleep(0.2)
    assert memory.pinned_blocks == 5 * chunk, "a chunk ahead of use: the thread pauses again"
    memory.release()


def test_release_ends_the_pinning_threads_pause(monkeypatch):
    import time

    import torch

    monkeypatch.setattr(host_memory, "PIN_DUTY", 1e-6)
    memory = host_memory.HostMemory(2, 12, (16, 2, 8), torch.float32, torch.device("cpu"), chunk_bytes=1)
    monkeypatch.setattr(memory, "_register", lambda address, size: time.sleep(0.01))
    memory.ahead_blocks = 3 * memory.chunk_blocks
    memory.start()
    deadline = time.monotonic() + 30
    while memory.pinned_blocks < memory.chunk_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # chunk 0, then chunk 1's first registration and the pause
    t = time.perf_counter()
    memory.release()
    assert time.perf_counter() - t < 30, "release() waited out a pause"
    assert memory.bytes_pinned == 0


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_pinned_and_capacity_bytes_count_an_fp8_tiers_scales(kv):
    """An fp8 tier's scales (float32 per (token, KV head), keys and values, every layer and host
    block) are pinned at once and counted in the capacity and the pinned bytes; a bf16 tier counts
    its keys and values only, as ever."""
    import torch

    from nanovllm.kvcache.host_tier import HostTier

    layers, blocks, block, heads, dim = 3, 40, 16, 2, 8
    dtype = torch.bfloat16 if kv == "bfloat16" else torch.float8_e4m3fn
    tier = HostTier(layers, block, heads, dim, dtype, torch.device("cpu"), blocks, 2, chunk_bytes=1,
                    scaled=kv == "fp8")
    memory = tier.memory
    kv_bytes = 2 * layers * -(-blocks * block * heads * dim * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    scale_bytes = 0 if kv == "bfloat16" else 2 * layers * blocks * block * heads * 4
    assert (memory.kv_bytes, memory.scale_bytes, memory.capacity_bytes) == (kv_bytes, scale_bytes,
                                                                            kv_bytes + scale_bytes)
    if kv == "fp8":
        assert tier.k_host_scale is memory.k_scale and tier.v_host_scale is memory.v_scale
        assert memory.k_scale.shape == (layers, blocks, block, heads) and memory.k_scale.dtype == torch.float32
    else:
        assert memory.k_scale is None and tier.k_host_scale is None
    assert memory.bytes_pinned == scale_bytes, "the scales from the start, keys and values on demand"
    memory.start()
    memory.ensure(blocks)
    assert memory.bytes_pinned == memory.capacity_bytes == kv_bytes + scale_bytes
    memory.release()
    assert memory.bytes_pinned == scale_bytes, "keys and values unpinned; the scales live with their tensors"


def test_engine_reports_an_fp8_host_tiers_scales_as_pinned(llama3_dir):
    with build_llm(llama3_dir, max_model_len=3100, num_kvcache_blocks=8, kv_cache_dtype="fp8", **HOST) as llm:
        cache = llm.model_runner.cache
        g, memory = cache.geometry, cache.host.memory
        assert memory.scale_bytes == 2 * g.num_layers * 64 * g.block_size * g.num_kv_heads * 4
        llm.generate([random_prompt(3000, seed=511)], greedy(4), use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["host_bytes_pinned"] == memory.bytes_pinned > memory.scale_bytes


def test_prefix_reuse_benchmark_on_cpu(llama3_dir, capsys):
    """benchmarks/prefix_reuse.py with tiny sizes: the host tier finds every document again in the
    second round (recomputed without it), with the same tokens; it prints its JSON report."""
    import json

    from benchmarks.prefix_reuse import main

    report = main(["--model", llama3_dir, "--device", "cpu", "--dtype", "float32", "--enforce-eager",
                   "--num-docs", "4", "--doc-len", "512", "--gpu-docs", "2", "--num-rounds", "2",
                   "--question-len", "16", "--max-tokens", "4"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert report["tokens_identical"]
    host, recompute = report["host"], report["recompute"]
    assert [r["cached_tokens_mean"] for r in host["rounds"]] == [0, 512]
    assert recompute["rounds"][1]["cached_tokens_mean"] < 512
    assert host["kv_cache"]["evicted_blocks"] > 0 and host["kv_cache"]["gpu_blocks_used"] == 0
    assert report["ttft_speedup_rounds_2_on"] == round(recompute["ttft_mean_s_rounds_2_on"]
                                                       / host["ttft_mean_s_rounds_2_on"], 2)
