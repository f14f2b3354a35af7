"""The decode reuse cache (nanovllm/kvcache/reuse.py) and the per-layer reads of a choosing policy
(nanovllm/kvcache/selection.py, pipeline.py), by hand: row placement and eviction, and a two-step
decode over both tiers whose outputs equal the reference over the picked blocks and whose reuse
and traffic counters equal the hand-computed ones (CPU, float32). Engine-level checks (QUEST equal
to FULL through the cache, the cache changing traffic but not tokens) are in tests/test_tiers.py."""
import pytest
import torch

from nanovllm.kvcache.reuse import ReuseCache

BLOCK, HEADS_Q, HEADS_KV, DIM, LAYERS = 256, 4, 2, 32, 2


def test_reuse_cache_keeps_recent_picks_per_layer_and_forgets_rewritten_blocks():
    cache = ReuseCache(num_layers=2, num_rows=3, first_row=10)
    assert cache.place(0, [7, 8]) == ({7: 10, 8: 11}, [(7, 10), (8, 11)])
    # 8 is found; 9 takes the last free row; 5 evicts 7, the least recently read
    assert cache.place(0, [8, 9, 5]) == ({8: 11, 9: 12, 5: 10}, [(9, 12), (5, 10)])
    assert cache.place(1, [8]) == ({8: 10}, [(8, 10)]), "each layer has its own rows"
    # 1, 2, 3 evict 8, 9, 5 (least recent first); 4 finds every row taken by this step's blocks
    assert cache.place(0, [1, 2, 3, 4]) == ({1: 11, 2: 12, 3: 10}, [(1, 11), (2, 12), (3, 10)])
    cache.forget([2, 8])
    assert list(cache.cached(0).items()) == [(1, 11), (3, 10)] and cache.cached(1) == {}
    assert cache.place(0, [3, 2]) == ({3: 10, 2: 12}, [(2, 12)]), "2 is loaded again into a freed row"
    assert list(cache.cached(0).items()) == [(1, 11), (3, 10), (2, 12)], "least recently read first"


class _ScriptedPolicy:
    """A choosing policy whose picks are given per layer (``script[layer]``: per choosing
    sequence, its picked logical blocks); sequences of more than 3 blocks choose."""

    chooses_decode_blocks, needs_block_metadata, dense_prefill = True, False, True
    script: dict[int, list[list[int]]] = {}

    @staticmethod
    def selects(num_blocks):
        return num_blocks > 3

    @staticmethod
    def fixed_decode_blocks(num_blocks):
        return [0, num_blocks - 1]

    def select_decode_blocks(self, layer, q, blocks):
        rows = self.script[layer]
        assert q.shape[0] == len(rows) == len(blocks.rows)
        width = max(map(len, rows))
        return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int64)


def _reference(q_row, kv, host, layer, gpus, hosts, length, read):
    """Attention of one query over the logical blocks ``read`` (the last one partial)."""
    from nanovllm.ops import decode_attention_ref

    keys, values = [], []
    for j in read:
        k, v = (kv[0, layer, gpus[j]], kv[1, layer, gpus[j]]) if gpus[j] >= 0 else \
            (host.k_host[layer, hosts[j]], host.v_host[layer, hosts[j]])
        n = length - j * BLOCK if j == len(gpus) - 1 else BLOCK
        keys.append(k[:n])
        values.append(v[:n])
    k, v = torch.cat(keys)[None], torch.cat(values)[None]
    return decode_attention_ref(q_row[None], k, v, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([k.shape[1]], dtype=torch.int32), DIM ** -0.5)[0]


def test_decode_reads_picks_through_reuse_cache_and_ring_with_hand_counted_reuse():
    """Two decode steps of three sequences: A (5 blocks, 3 on the host) and B (4 blocks, 1 on the
    host) choose; C (3 blocks) reads all of its blocks, its block 1 (host block 3, shared with A as
    a common prefix would be) through the ring, prefetched a layer ahead. The reuse cache has 2 rows
    per layer (GPU-tier blocks 7 and 8). Between the steps host block 4 is rewritten (a spill), so
    its copy must not be reused.

    Step 1, layer 0: A picks 1, 3 (host 3, 4), B picks 2 (host 1): 3 -> row 7, 4 -> row 8 (loaded),
    1 finds no row (ring); C reads host 3 through the ring only. Layer 1: A picks 2 (host 0) ->
    row 7 (loaded); B picks 1 (GPU block 5). Step 2, layer 0: the same picks: 3 is found (row 7),
    4 was forgotten and is loaded again (row 8), 1 goes through the ring. Layer 1: host 0 is found.
    Reuse: layer 0 1 of 6 host picks, layer 1 1 of 2. Host reads (loads, K and V of one layer):
    layer 0 4 + 3 (C's fixed block each step, the ring's host 1, the cache loads), layer 1 2 + 1."""
    from nanovllm.kvcache.host_tier import HostTier
    from nanovllm.kvcache.pipeline import TieredAttention
    from nanovllm.kvcache.selection import DecodeSelection
    from nanovllm.sparse import SparseStats
    from nanovllm.utils.context import Context, reset_context, set_context

    gen = torch.Generator().manual_seed(0)
    gpu_blocks, rows = 7, 2
    kv = torch.randn(2, LAYERS, gpu_blocks + rows, BLOCK, HEADS_KV, DIM, generator=gen)
    host = HostTier(LAYERS, BLOCK, HEADS_KV, DIM, torch.float32, torch.device("cpu"), 6, 2)
    host.k_host.copy_(torch.randn(host.k_host.shape, generator=gen))
    host.v_host.copy_(torch.randn(host.v_host.shape, generator=gen))
    policy, stats = _ScriptedPolicy(), SparseStats()
    attention = TieredAttention(policy, stats, DIM ** -0.5)
    reuse = ReuseCache(LAYERS, rows, gpu_blocks)
    attention.bind(kv[0], kv[1], host, reuse)
    tables = [([0, -1, -1, -1, 2], [-1, 3, 0, 4, -1], 4 * BLOCK + 10),
              ([1, 5, -1, 4], [-1, -1, 1, -1], 3 * BLOCK + 100),
              ([6, -1, 3], [-1, 3, -1], 2 * BLOCK + 5)]
    scripts = [{0: [[1, 3], [2]], 1: [[2], [1]]}, {0: [[1, 3], [2]], 1: [[2], [1]]}]
    for step, script in enumerate(scripts):
        if step == 1:  # a spill rewrites host block 4
            attention.forget_host_blocks([4])
            host.k_host[:, 4].copy_(torch.randn(host.k_host[:, 4].shape, generator=gen))
        policy.script = script
        selection = DecodeSelection.build(policy, tables, gpu_blocks, BLOCK, torch.device("cpu"))
        ctx = Context(is_prefill=False, host_loads=[(r, h) for r, (_, hosts, _) in enumerate(tables)
                                                    for h in hosts if h >= 0], selection=selection)
        ctx.slot_mapping = torch.full((3,), -1, dtype=torch.int64)
        q = torch.randn(3, HEADS_Q, DIM, generator=gen)
        set_context(ctx)
        attention.begin_step(ctx)
        try:
            for layer in range(LAYERS):
                out = attention.forward(layer, q, torch.zeros(3, HEADS_KV, DIM), torch.zeros(3, HEADS_KV, DIM))
                reads = [sorted({0, 4, *script[layer][0]}), sorted({0, 3, *script[layer][1]}), [0, 1, 2]]
                for r, (gpus, hosts, length) in enumerate(tables):
                    ref = _reference(q[r], kv, host, layer, gpus, hosts, length, reads[r])
                    assert (out[r] - ref).abs().max() <= 1e-5, (step, layer, r)
        finally:
            reset_context()
        assert attention.ring.consumed == len(attention.ring.plan) == 3, "C's block per layer, B's host 1 at layer 0"
    assert reuse.cached(0) == {3: 7, 4: 8} and reuse.cached(1) == {0: 7}
    decode = stats.to_dict(True)["decode"]
    assert [r["reuse_rate"] for r in decode["per_layer"]] == [1 / 6, 1 / 2]
    assert (decode["reused_host_blocks"], decode["selected_host_blocks"]) == (2, 8)
    assert (decode["loaded_host_blocks"], decode["available_host_blocks"]) == (10, 20)
    assert host.bytes_h2d == 10 * 2 * host.block_bytes


def test_reuse_cache_option_is_checked(qwen3_dir):
    from _util import build_llm
    from nanovllm.config import Config
    from nanovllm.kvcache.reuse import reuse_cache_rows

    quest = dict(enable_cpu_offload=True, sparse_policy="QUEST", sparse_topk_blocks=3)
    assert reuse_cache_rows(Config(qwen3_dir, **quest)) == 3, "default: one step's picks"
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


def test_reuse_cache_rows_follow_the_gpu_tier_and_are_budgeted(qwen3_dir):
    from _util import build_llm

    with build_llm(qwen3_dir, enable_cpu_offload=True, num_cpu_kvcache_blocks=8, num_ring_slots=2,
                   sparse_policy="QUEST", num_reuse_cache_blocks=3) as llm:
        cache, gpu_blocks = llm.model_runner.cache, llm.get_kv_cache_stats()["gpu_blocks"]
        g = cache.geometry
        assert cache.kv.shape[2] == gpu_blocks + 3 and cache.attention.reuse.first_row == gpu_blocks
        layer_block = g.block_bytes // g.num_layers
        assert cache.reserved_bytes(8) == 2 * layer_block + 8 * cache.metadata_bytes_per_block() + 3 * g.block_bytes
