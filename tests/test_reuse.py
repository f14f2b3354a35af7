"""The decode reuse cache and staging rows (nanovllm/kvcache/reuse.py) and the device-side reads
of a choosing policy (nanovllm/kvcache/selection.py, tiered_attention.py), by hand: victim choice, a step's
outcome recorded a step late, and multi-step decodes over both tiers whose outputs equal, bit for
bit in float32, what the former host-side path computed (the same blocks in the same logical order
through the same kernels), with hand-counted reuse and traffic. Engine-level checks (QUEST equal to
FULL through the cache, the cache changing traffic but not tokens) are in tests/test_tiers.py."""
import pytest
import torch

from nanovllm.kvcache.reuse import DEFAULT_ROWS_PER_PICK, ReuseCache
from nanovllm.kvcache.tier_rows import TierRows

BLOCK, HEADS_Q, HEADS_KV, DIM, LAYERS = 256, 4, 2, 32, 2


def test_victims_are_free_rows_then_least_recent_rows_unused_last_step():
    cache = ReuseCache(num_layers=2, num_rows=3, first_row=10)
    assert cache.begin_step(2) == [[10, 11], [10, 11]], "free rows first, at most the misses possible"
    assert cache.cached(0) == {}
    cache.record(0, [], [(7, 10), (8, 11)])
    cache.record(1, [], [(8, 10)])
    assert cache.cached(0) == {7: 10, 8: 11} and cache.cached(1) == {8: 10}, "victim 11 of layer 1 unused: free"
    # layer 0: rows 10 and 11 were placed last step, so only the free row 12 is a victim
    assert cache.begin_step(4) == [[12], [12, 11]]
    cache.record(0, [8], [(9, 12)])
    cache.record(1, [8], [])
    assert list(cache.cached(0).items()) == [(7, 10), (8, 11), (9, 12)], "least recently used first"
    assert cache.begin_step(1) == [[10], [12]], "7 (row 10) was not read last step; layer 1's free row 12"
    assert cache.cached(0) == {8: 11, 9: 12}, "a victim's entry leaves the map the step uploads"
    cache.record(0, [], [(5, 10)])
    cache.record(1, [], [])
    cache.forget([9, 8])
    assert cache.cached(0) == {5: 10} and cache.cached(1) == {}
    assert cache.begin_step(3) == [[12, 11], [11, 12, 10]], "forgotten rows are free again"


def _hits_while_picks_drift(rows: int, top_k: int = 4, steps: int = 12) -> list[int]:
    """Hits per step of one sequence whose top-k picks slide by one block a step."""
    cache = ReuseCache(num_layers=1, num_rows=rows, first_row=0)
    hits_per_step = []
    for step in range(steps):
        picks = list(range(step, step + top_k))
        victims, cached = cache.begin_step(top_k)[0], cache.cached(0)
        hits = [b for b in picks if b in cached]
        cache.record(0, hits, list(zip([b for b in picks if b not in cached], victims)))
        hits_per_step.append(len(hits))
    return hits_per_step


def test_default_rows_cache_every_block_from_its_second_step():
    """With one row per pick a step that filled every row leaves the next no victim, so a new
    block is cached a step late (2 hits of 3 possible); the default two rows per pick reuse every
    block after its first step."""
    top_k = 4
    assert _hits_while_picks_drift(DEFAULT_ROWS_PER_PICK * top_k, top_k) == [0] + [top_k - 1] * 11
    assert _hits_while_picks_drift(top_k, top_k)[2:] == [top_k - 2] * 10


def test_a_block_picked_by_two_sequences_keeps_one_row():
    cache = ReuseCache(num_layers=1, num_rows=2, first_row=0)
    cache.begin_step(2)
    cache.record(0, [], [(4, 0), (4, 1)])
    assert cache.cached(0) == {4: 1}
    assert cache.begin_step(2) == [[0]]


class _ScriptedPolicy:
    """A choosing policy whose picks are given per layer (``script[layer]``: per choosing
    sequence, its picked logical blocks); sequences of more than 3 blocks choose."""

    chooses_decode_pages, needs_block_metadata, dense_prefill = True, False, True
    script: dict[int, list[list[int]]] = {}

    @staticmethod
    def selects(num_blocks):
        return num_blocks > 3

    @staticmethod
    def fixed_decode_blocks(num_blocks):
        return [0, num_blocks - 1]

    @staticmethod
    def max_decode_picks(num_candidates):
        return min(2, num_candidates)

    def select_decode_blocks(self, layer, q, blocks):
        rows = self.script[layer]
        assert q.shape[0] == len(rows) == len(blocks.rows)
        width = max(map(len, rows))
        return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int64)


def _former_path(q, kv, host, layer, tables, policy, picks):
    """What the host-side path computed at ``layer`` when the reuse cache had a row for every
    picked host block: one paged read (``decode_attention`` with the LSE) of each sequence's read
    blocks in logical order, the GPU-tier ones in place and the picked host ones from rows holding
    copies, then its fixed host blocks folded in through ``decode_attend_merge``, sequence by
    sequence."""
    from nanovllm.ops import decode_attend_merge, decode_attention

    k_rows, v_rows = [kv[0, layer]], [kv[1, layer]]
    extra, table_rows, lens, ring = kv.shape[2], [], [], []
    for r, (gpus, hosts, length) in enumerate(tables):
        n = len(gpus)
        choosing = policy.selects(n)
        fixed = sorted({*policy.fixed_decode_blocks(n), n - 1}) if choosing else list(range(n))
        read = sorted(fixed + (picks[layer][sum(policy.selects(len(t[0])) for t in tables[:r])] if choosing else []))
        table = []
        for j in read:
            if gpus[j] >= 0:
                table.append(gpus[j])
            elif j in fixed:
                ring.append((r, hosts[j]))
            else:
                k_rows.append(host.k_host[layer, hosts[j]][None])
                v_rows.append(host.v_host[layer, hosts[j]][None])
                table.append(extra)
                extra += 1
        table_rows.append(table)
        lens.append(len(table) * BLOCK - (n * BLOCK - length))
    width = max(map(len, table_rows))
    tables_t = torch.tensor([t + [-1] * (width - len(t)) for t in table_rows], dtype=torch.int32)
    out, lse = decode_attention(q, torch.cat(k_rows), torch.cat(v_rows), tables_t,
                                torch.tensor(lens, dtype=torch.int32), DIM ** -0.5, return_lse=True)
    for r, h in ring:
        decode_attend_merge(q[r], host.k_host[layer, h], host.v_host[layer, h], out[r], lse[r], DIM ** -0.5)
    return out.to(q.dtype)


def _decode(attention, policy, tables, scripts, layout, kv, host, gen, reuse=None, spills=None, atol=0.0):
    """Decode steps over the tiers with ``scripts[step][layer]`` as the picks; host block ``h``
    of ``spills[step]`` is rewritten before that step (a spill). Asserts every layer's output is
    the former path's, bit for bit (or within ``atol``)."""
    from nanovllm.kvcache.selection import DecodeSelection
    from nanovllm.kvcache.context import Context, reset_context, set_context

    for step, script in enumerate(scripts):
        attention.flush()  # KVCache.begin_step
        for h in (spills or {}).get(step, []):
            attention.forget_host_blocks([h])
            host.k_host[:, h].copy_(torch.randn(host.k_host[:, h].shape, generator=gen))
        policy.script = script
        selection = DecodeSelection.build(policy, tables, layout, layout.layer_rows - (reuse.num_rows if reuse else 0),
                                          BLOCK, torch.device("cpu"), reuse)
        ctx = Context(is_prefill=False, host_loads=[(r, h) for r, (_, hosts, _) in enumerate(tables)
                                                    for h in hosts if h >= 0], selection=selection)
        ctx.slot_mapping = torch.full((len(tables),), -1, dtype=torch.int64)
        q = torch.randn(len(tables), HEADS_Q, DIM, generator=gen)
        set_context(ctx)
        attention.begin_step(ctx)
        try:
            for layer in range(LAYERS):
                zeros = torch.zeros(len(tables), HEADS_KV, DIM)
                out = attention.forward(layer, q, zeros, zeros)
                former = _former_path(q, kv, host, layer, tables, policy, script)
                assert torch.equal(out, former) if not atol else (out - former).abs().max() <= atol, (step, layer)
            attention.end_step()
        finally:
            reset_context()
    attention.flush()


def _tiers(gpu_blocks, reuse_rows, staging_rows, host_blocks=8):
    from nanovllm.kvcache.host_tier import HostTier
    from nanovllm.kvcache.tiered_attention import TieredAttention
    from nanovllm.sparse import SparseStats

    gen = torch.Generator().manual_seed(0)
    layout = TierRows(LAYERS, gpu_blocks + reuse_rows, staging_rows)
    rows = torch.randn(2, layout.total, BLOCK, HEADS_KV, DIM, generator=gen)
    kv = rows[:, :layout.staging_base].unflatten(1, (LAYERS, layout.layer_rows))
    host = HostTier(LAYERS, BLOCK, HEADS_KV, DIM, torch.float32, torch.device("cpu"), host_blocks, 2)
    host.k_host.copy_(torch.randn(host.k_host.shape, generator=gen))
    host.v_host.copy_(torch.randn(host.v_host.shape, generator=gen))
    policy, stats = _ScriptedPolicy(), SparseStats()
    attention = TieredAttention(policy, stats, DIM ** -0.5)
    reuse = ReuseCache(LAYERS, reuse_rows, gpu_blocks) if reuse_rows else None
    attention.bind(rows, layout, host, reuse)
    return attention, policy, stats, reuse, layout, kv, host, gen


TABLES = [([0, -1, -1, -1, 2], [-1, 3, 0, 4, -1], 4 * BLOCK + 10),
          ([1, 5, -1, 4], [-1, -1, 1, -1], 3 * BLOCK + 100),
          ([6, -1, 3], [-1, 3, -1], 2 * BLOCK + 5),
          ([8, -1, -1, 9], [-1, 3, 5, -1], 3 * BLOCK + 1)]
"""A (5 blocks, 3 on the host) and B (4 blocks, 1 on the host) choose; C (3 blocks) reads all of
its blocks, its block 1 (host block 3, shared with A and D as a common prefix would be) through the
ring; D chooses among host blocks 3 and 5."""


def test_device_reads_equal_the_former_path_and_lag_the_reuse_cache_a_step():
    """Three steps, two layers, 2 reuse rows per layer (GPU-tier blocks 10, 11), 8 staging rows;
    host block 4 is rewritten (a spill) before step 2, so its copy must not be reused.

    Layer 0 picks A: 1, 3 (host 3, 4), B: 2 (host 1), D: 1 (host 3) every step; layer 1 picks A: 2
    (host 0), B: 1 (GPU block 5), D: 2 (host 5). A step may miss 2 + 1 + 2 blocks per layer.
    Step 0, layer 0: 4 misses; victims 10, 11 take host 3 (A) and 4; host 1 (B) and 3 (D) go to
    staging. Layer 1: host 0 -> 10, host 5 -> 11.
    Step 1: rows 10, 11 were placed last step, so no victims. Layer 0: host 3 (A, D) and 4 are
    found, host 1 goes to staging. Layer 1: both found.
    Step 2: host 4 was forgotten (row 11 free). Layer 0: victim 11 (free), row 10 kept (found last
    step): host 3 found (A, D), host 4 -> 11, host 1 to staging. Layer 1: both found.
    Reuse: layer 0 0 + 3 + 2 of 12 host picks, layer 1 0 + 2 + 2 of 6. Host reads (K and V of one
    layer): C's host block per layer and step through the ring (6) and the misses (7 + 2)."""
    attention, policy, stats, reuse, layout, kv, host, gen = _tiers(gpu_blocks=10, reuse_rows=2, staging_rows=8)
    script = {0: [[1, 3], [2], [1]], 1: [[2], [1], [2]]}
    _decode(attention, policy, TABLES, [script] * 3, layout, kv, host, gen, reuse, spills={2: [4]})
    assert reuse.cached(0) == {3: 10, 4: 11} and reuse.cached(1) == {0: 10, 5: 11}
    decode = stats.to_dict(True, False)["decode"]
    assert [r["reuse_rate"] for r in decode["per_layer"]] == [5 / 12, 4 / 6]
    assert (decode["reused_host_blocks"], decode["selected_host_blocks"]) == (9, 18)
    assert (decode["loaded_host_blocks"], decode["available_host_blocks"]) == (6 + 9, 3 * LAYERS * 7)
    assert host.bytes_h2d == (6 + 9) * 2 * host.block_bytes
    assert attention.ring.consumed == len(attention.ring.plan) == LAYERS, "C's host block per layer"


def test_without_reuse_cache_every_picked_host_block_is_gathered_into_staging_rows():
    attention, policy, stats, _, layout, kv, host, gen = _tiers(gpu_blocks=10, reuse_rows=0, staging_rows=5)
    scripts = [{0: [[1, 3], [2], [1]], 1: [[2], [1], [2]]}, {0: [[2, 3], [1], [2, 1]], 1: [[1, 2], [2], [1]]}]
    _decode(attention, policy, TABLES, scripts, layout, kv, host, gen)
    decode = stats.to_dict(True, False)["decode"]
    assert decode["reuse_rate"] is None and decode["selected_host_blocks"] == 0
    assert (decode["loaded_host_blocks"], decode["available_host_blocks"]) == (4 + (4 + 2) + (4 + 4), 4 * 7)


def test_groups_reuse_the_staging_rows_when_misses_could_overflow_them():
    """2 staging rows, no reuse cache: A may miss 2, B 1, D 2 host blocks per layer, so the
    choosing sequences are read in three groups (A, B, D), each group's misses gathered into the
    staging rows that the group before read. The outputs equal the former path's within rounding
    (each group is its own paged read)."""
    from nanovllm.kvcache.selection import DecodeSelection

    attention, policy, stats, _, layout, kv, host, gen = _tiers(gpu_blocks=10, reuse_rows=0, staging_rows=2)
    policy.script = {0: [[1, 3], [2], [1, 2]], 1: [[2], [1], [2]]}
    selection = DecodeSelection.build(policy, TABLES, layout, 10, BLOCK, torch.device("cpu"))
    assert [g for g, _ in selection.groups] == [0, 1, 2]
    assert [rows.tolist() for _, rows in selection.groups] == [[0, 2], [1], [3]], "C (not choosing) with group 0"
    _decode(attention, policy, TABLES, [policy.script] * 2, layout, kv, host, gen, atol=1e-5)
    decode = stats.to_dict(True, False)["decode"]
    assert (decode["loaded_host_blocks"], decode["available_host_blocks"]) == (2 * (2 + 5 + 2), 2 * 2 * 7)
def test_tables_are_as_wide_as_the_most_reads():
    """A, B and D each read their two fixed blocks (first and last, in the GPU tier) and at most 2
    picks (the policy's ``max_decode_picks``), C (not choosing) its 2 GPU-tier blocks: tables of 4
    columns, not A's 5 logical blocks. Picks with more columns than that, -1 beyond a row's valid
    picks (QUEST's when top-k exceeds the candidates), fit them."""
    from nanovllm.kvcache.selection import DecodeSelection

    _, policy, *_ = _tiers(gpu_blocks=10, reuse_rows=0, staging_rows=8)
    layout = TierRows(LAYERS, 10, 8)
    selection = DecodeSelection.build(policy, TABLES, layout, 10, BLOCK, torch.device("cpu"))
    assert selection.other_tables.shape[1] == 4 < selection.width == 5
    for picks in (torch.tensor([[1, 3], [2, -1], [1, 2]]), torch.tensor([[1, 3, -1, -1], [2, 1, -1, -1],
                                                                         [2, 1, -1, -1]])):
        _, _, tables, lens = selection.layer_reads(0, picks)  # the reference raises if a row reads more
        assert tables.shape == (4, 4) and (tables[[0, 3]] >= 0).all(), "A and D read 4 blocks each"
    with pytest.raises(ValueError, match="reads 5 blocks, more than the 4 columns"):
        selection.layer_reads(1, torch.tensor([[1, 2, 3], [2, -1, -1], [1, 2, -1]]))
    # every row picking its most: the tables and the ring's fixed loads read num_reads blocks
    _, _, tables, _ = selection.layer_reads(0, torch.tensor([[1, 3], [2, 1], [1, 2]]))
    assert int((tables >= 0).sum()) + len(selection.fixed_loads) == selection.num_reads() == 4 + 4 + 3 + 4


def test_reuse_cache_option_is_checked(qwen3_dir):
    from _util import build_llm
    from nanovllm.config import Config
    from nanovllm.kvcache.reuse import reuse_cache_rows

    quest = dict(enable_cpu_offload=True, sparse_policy="QUEST", sparse_topk_blocks=3)
    assert reuse_cache_rows(Config(qwen3_dir, **quest)) == 6, "default: two rows per pick"
    assert reuse_cache_rows(Config(qwen3_dir, **quest, num_reuse_cache_blocks=5)) == 5
    assert reuse_cache_rows(Config(qwen3_dir, **quest, num_reuse_cache_blocks=0)) == 0
    with build_llm(qwen3_dir, sparse_policy="QUEST") as llm:
        assert llm.model_runner.cache.reuse_rows == 0, "no host tier"
    for bad, match in ((-2, "num_reuse_cache_blocks must be >= 0"), (1.5, "must be an integer")):
        with pytest.raises(ValueError, match=match):
            Config(qwen3_dir, **quest, num_reuse_cache_blocks=bad)
    with pytest.raises(ValueError, match="num_reuse_cache_blocks=2 needs enable_cpu_offload=True"):
        Config(qwen3_dir, sparse_policy="QUEST", num_reuse_cache_blocks=2)
    with pytest.raises(ValueError, match="and sparse_policy='QUEST'"):
        Config(qwen3_dir, enable_cpu_offload=True, num_reuse_cache_blocks=2)
    with pytest.raises(ValueError, match="at least 1 row"):
        ReuseCache(2, 0, 10)


def test_reuse_cache_and_staging_rows_follow_the_gpu_tier_and_are_budgeted(qwen3_dir):
    from _util import build_llm
    from nanovllm.kvcache.tier_rows import STAGING_SEQS, staging_rows

    with build_llm(qwen3_dir, enable_cpu_offload=True, num_cpu_kvcache_blocks=8, num_ring_slots=2,
                   sparse_policy="QUEST", num_reuse_cache_blocks=3) as llm:
        cache, gpu_blocks = llm.model_runner.cache, llm.get_kv_cache_stats()["gpu_blocks"]
        g = cache.geometry
        assert cache.kv.shape[2] == gpu_blocks + 3 and cache.attention.reuse.first_row == gpu_blocks
        staging = llm.config.sparse_topk_blocks * min(llm.config.max_num_seqs, STAGING_SEQS)
        assert cache.staging_rows == staging_rows(llm.config) == staging
        assert cache.attention.k_rows.shape[0] == cache.layout.total == g.num_layers * (gpu_blocks + 3) + staging
        assert cache.attention.k_rows.data_ptr() == cache.kv[0, 0, 0].data_ptr(), "one table of rows"
        layer_block = g.block_bytes // g.num_layers
        assert cache.reserved_bytes(8) == (2 + staging) * layer_block + 8 * cache.metadata_bytes_per_block() \
            + 3 * g.block_bytes


def test_an_unused_victim_keeps_its_block_and_a_step_must_be_recorded_first():
    """A victim that no miss filled was not written: its block returns as the least recently used
    entry, unless that block was placed again in another row or forgotten meanwhile; a released
    layer (a step that stopped there) frees its victims; a step cannot begin before the previous
    one is recorded."""
    def warm():
        cache = ReuseCache(num_layers=1, num_rows=3, first_row=0)
        cache.begin_step(3)
        cache.record(0, [], [(5, 0), (6, 1), (7, 2)])
        assert cache.begin_step(1) == [[]], "every row was placed last step"
        cache.record(0, [7], [])
        assert cache.begin_step(2) == [[0, 1]] and cache.cached(0) == {7: 2}, "5 and 6 leave the uploaded map"
        return cache

    cache = warm()
    with pytest.raises(RuntimeError, match="previous step's victims were not recorded"):
        cache.begin_step(2)
    cache.record(0, [7], [(8, 0)])  # one miss filled row 0; row 1 (block 6) was not written
    assert list(cache.cached(0).items()) == [(6, 1), (7, 2), (8, 0)], "6 is back, least recently used"
    assert cache.begin_step(2) == [[1]]
    cache.forget([6])
    cache.record(0, [], [])
    assert cache.cached(0) == {7: 2, 8: 0} and cache.begin_step(1) == [[1]], "forgotten while a victim: freed"
    cache.release(0)
    assert cache.cached(0) == {7: 2, 8: 0} and cache.begin_step(3) == [[1, 2, 0]], "released: row 1 free"

    cache = warm()
    cache.record(0, [], [(6, 0)])  # 6 missed (it had left the map) and landed in row 0
    assert cache.cached(0) == {7: 2, 6: 0} and cache.begin_step(1) == [[1]], "row 1's old copy of 6: freed"


def test_a_reuse_cache_too_large_to_allocate_is_named(qwen3_dir):
    """A reuse cache that cannot be allocated (its size defaults to sparse_topk_blocks) is named in
    the error, not only num_kvcache_blocks."""
    from _util import build_llm
    with pytest.raises(RuntimeError, match="10000000000 reuse-cache rows \\(num_reuse_cache_blocks"):
        build_llm(qwen3_dir, enable_cpu_offload=True, num_kvcache_blocks=8, num_cpu_kvcache_blocks=8,
                  sparse_policy="QUEST", num_reuse_cache_blocks=10**10)
