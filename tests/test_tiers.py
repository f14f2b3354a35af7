"""The two-tier KV cache against the GPU-only engine (CPU, float32, tiny random checkpoints).

With the host tier on and the GPU tier forced small, blocks are spilled to the host tier and read
back through the ring (decode) or gathered from both tiers (prefill); greedy tokens and logits
must equal the GPU-only engine's, with and without prefix-cache hits, under preemption, with the
sparse policies at their exact settings, and with tensor parallelism; with an fp8 KV cache too
(``kv_cache_dtype="fp8"``: each token is quantized once as it is stored and its scales move with
its block, so a tier split gives the GPU-only fp8 engine's tokens; its logits agree to
:data:`FP8_LOGIT_TOL`). Unit tests below check the block manager's placement and the attention
pipeline against the references (``test_fp8_kv.py`` the fp8 pipeline's, exactly).
"""
import sys

import pytest
import torch

from _util import build_llm, generate_with_logits, greedy, prefill, random_prompt
from nanovllm.sparse.choosing import ChoosingPolicy

BLOCK = 256
PROMPT_LENS = (1, 100, 255, 256, 257, 1000, 3000, 700)
DECODE = 64
MAX_MODEL_LEN = 3100
BATCH_BLOCKS = sum(-(-(n + DECODE) // BLOCK) for n in PROMPT_LENS)  # 28: the batch's KV, all at once
HOST = dict(enable_cpu_offload=True, num_cpu_kvcache_blocks=64, num_ring_slots=3)


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=n) for n in PROMPT_LENS]


KV_DTYPES = ["auto", "fp8"]
FP8_LOGIT_TOL = 1e-3
"""Logits of a tier split against GPU-only with fp8 KV: decode over the ring sums in another order
(as with float32 KV, where they agree to 1e-5), and a later layer's key of a decoded token then
now and then rounds to the neighbouring fp8 value (measured up to 5e-5)."""


def _reference(model_dir, prompts, kv_cache_dtype="auto"):
    with build_llm(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, kv_cache_dtype=kv_cache_dtype) as llm:
        return generate_with_logits(llm, prompts, DECODE)


@pytest.fixture(scope="module")
def references(llama3_dir, qwen3_dir, prompts):
    """GPU-only outputs per architecture (``"llama3"``, ``"qwen3"``) and, computed when first
    asked for, per (architecture, kv_cache_dtype)."""
    dirs = {"llama3": llama3_dir, "qwen3": qwen3_dir}

    class References(dict):
        def __missing__(self, key):
            if isinstance(key, str):
                return self[key, "auto"]
            self[key] = _reference(dirs[key[0]], prompts, key[1])
            return self[key]

    return References()


def _assert_equal(got, ref, kv="auto"):
    tokens, logits = got
    assert tokens == ref[0]
    for n, ours, theirs in zip(PROMPT_LENS, logits, ref[1]):
        assert (ours - theirs).abs().max().item() <= (1e-5 if kv == "auto" else FP8_LOGIT_TOL), f"prompt of {n} tokens"


def _assert_nothing_held(llm):
    stats = llm.get_kv_cache_stats()
    assert stats["gpu_blocks_used"] == stats["host_blocks_used"] == 0, stats
    assert llm.scheduler.block_manager.num_free_blocks == stats["gpu_blocks"] + stats["host_blocks"]


@pytest.mark.parametrize("gpu_blocks", [4, round(0.3 * BATCH_BLOCKS), round(0.7 * BATCH_BLOCKS)],
                         ids=["gpu~0%", "gpu~30%", "gpu~70%"])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_spilled_tiers_equal_gpu_only(request, prompts, references, arch, gpu_blocks, kv):
    """~0%: the smallest GPU tier that runs two sequences at once (each keeps its first block and
    the one it writes on the GPU); ~30% / ~70% of the batch's KV. A second generate of the same
    prompts, reversed, hits the prefix cache in both tiers. With fp8 KV the GPU-only fp8 engine's
    outputs."""
    ref = references[arch, kv]
    with build_llm(request.getfixturevalue(f"{arch}_dir"), max_model_len=MAX_MODEL_LEN,
                   num_kvcache_blocks=gpu_blocks, kv_cache_dtype=kv, **HOST) as llm:
        _assert_equal(generate_with_logits(llm, prompts, DECODE), ref, kv)
        stats = llm.get_kv_cache_stats()
        assert stats["spilled_blocks"] > 0 and stats["loaded_blocks"] > 0, stats
        assert stats["gpu_blocks"] == gpu_blocks and stats["host_blocks"] == HOST["num_cpu_kvcache_blocks"]
        _assert_nothing_held(llm)
        tokens, logits = generate_with_logits(llm, prompts[::-1], DECODE)
        _assert_equal((tokens[::-1], logits[::-1]), ref, kv)
        assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]
        _assert_nothing_held(llm)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_spilled_tiers_attend_their_prefixes_a_block_at_a_time(llama3_dir, prompts, references, monkeypatch, kv):
    """Prefill attends a prefix one segment at a time (what bounds a 1M-token prefill's memory);
    with segments of one block, every chunk of the ~0% split reads its prefix from both tiers in
    several segments, and the outputs are still GPU-only mode's."""
    import importlib

    ref = references["llama3", kv]
    ops = importlib.import_module("nanovllm.ops.prefill_attention")
    monkeypatch.setattr(ops, "PREFIX_SEGMENT_BYTES", 1)
    segments, rows = [], ops._prefix_rows
    monkeypatch.setattr(ops, "_prefix_rows", lambda i, n, first, last, *args: segments.append((first, last)) or
                        rows(i, n, first, last, *args))
    with build_llm(llama3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4, kv_cache_dtype=kv, **HOST) as llm:
        _assert_equal(generate_with_logits(llm, prompts, DECODE), ref, kv)
    assert segments and all(last - first <= BLOCK for first, last in segments)
    assert max(last for _, last in segments) >= 2500, "the longest prompt's prefixes read in ~10 segments"


def test_gpu_tier_holding_everything_spills_nothing(llama3_dir, prompts, references):
    with build_llm(llama3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=BATCH_BLOCKS + 4, **HOST) as llm:
        _assert_equal(generate_with_logits(llm, prompts, DECODE), references["llama3"])
        stats = llm.get_kv_cache_stats()
    assert stats["spilled_blocks"] == stats["loaded_blocks"] == 0
    assert stats["host_blocks_used"] == 0


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_preemption_with_both_tiers_full(llama3_dir, kv):
    """4 GPU + 1 host blocks for two 500-token prompts that grow to 3 blocks each: the first to
    cross a block boundary spills a block to the host, the second finds both tiers full and is
    preempted (recomputed once the first finishes); the outputs are the unconstrained ones."""
    prompts = [random_prompt(500, seed=11), random_prompt(500, seed=12)]
    ref = _reference(llama3_dir, prompts, kv)
    with build_llm(llama3_dir, max_model_len=1024, num_kvcache_blocks=4, enable_cpu_offload=True,
                   num_cpu_kvcache_blocks=1, num_ring_slots=2, kv_cache_dtype=kv) as llm:
        got = generate_with_logits(llm, prompts, DECODE)
        stats = llm.get_kv_cache_stats()
        _assert_nothing_held(llm)
    assert got[0] == ref[0]
    assert all((a - b).abs().max().item() <= (1e-5 if kv == "auto" else FP8_LOGIT_TOL) for a, b in zip(got[1], ref[1]))
    assert stats["preemptions"] >= 1 and stats["spilled_blocks"] >= 1, stats


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_repeated_prompt_hits_blocks_spilled_to_the_host(qwen3_dir, kv):
    """A 3,000-token prompt on a 4-block GPU tier: its blocks end on the host tier; the same
    prompt again finds 11 full blocks (2,816 tokens) there and gives the same output."""
    prompt = [random_prompt(3000, seed=77)]
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=4, kv_cache_dtype=kv, **HOST) as llm:
        first = llm.generate(prompt, greedy(20), use_tqdm=False)[0]
        assert llm.get_kv_cache_stats()["spilled_blocks"] >= 12 - 4, "all but 4 of its 12 blocks"
        second = llm.generate(prompt, greedy(20), use_tqdm=False)[0]
        assert first["num_cached_tokens"] == 0
        assert second["num_cached_tokens"] >= 2816
        assert second["token_ids"] == first["token_ids"]
        loaded_before = llm.get_kv_cache_stats()["loaded_blocks"]
        assert loaded_before > 0
        _assert_nothing_held(llm)
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, kv_cache_dtype=kv) as ref:
        assert ref.generate(prompt, greedy(20), use_tqdm=False)[0]["token_ids"] == first["token_ids"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_xattn_at_threshold_1_equals_full_across_tiers(qwen3_dir, prompts, references, kv):
    """XATTN_BSA at threshold 1.0 keeps every block: FULL's tokens and logits (QUEST reading every
    block: the test below). Chunks of 1,024 tokens, so that later chunks estimate over (and attend
    to) their prefix from both tiers, with fp8 KV dequantized."""
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=8, **HOST, sparse_policy="XATTN_BSA",
                   sparse_threshold=1.0, kv_cache_dtype=kv, max_num_batched_tokens=1024) as llm:
        _assert_equal(generate_with_logits(llm, prompts, DECODE), references["qwen3", kv], kv)
        assert llm.get_kv_cache_stats()["spilled_blocks"] > 0


@pytest.mark.parametrize("tiers", [dict(num_kvcache_blocks=64),
                                   dict(num_kvcache_blocks=8, **HOST, num_reuse_cache_blocks=0),
                                   dict(num_kvcache_blocks=8, **HOST, num_reuse_cache_blocks=1),
                                   dict(num_kvcache_blocks=8, **HOST, num_reuse_cache_blocks=32)],
                         ids=["gpu-only", "no-reuse-cache", "reuse-cache-1", "reuse-cache-32"])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_quest_selecting_every_page_equals_full(qwen3_dir, prompts, references, monkeypatch, tiers, kv):
    """QUEST with a budget covering the context, made to select for every sequence with a
    candidate page (its own rule reads everything without selecting then): each layer and KV head
    scores and picks every candidate, and the picks are read where they are: in place in the GPU
    tier, gathered per (page, KV head) into staging pages (no reuse cache), into reuse cells with
    evictions and staging overflow (1 row), or found there from the second step on (32 rows).
    FULL's tokens and logits (with fp8 KV, FULL's over fp8: the pages and their scales read where
    they are)."""
    monkeypatch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, sparse_policy="QUEST", sparse_token_budget=MAX_MODEL_LEN,
                   kv_cache_dtype=kv, **tiers) as llm:
        tokens, logits = generate_with_logits(llm, prompts, DECODE)
        decode = llm.get_sparse_stats()["decode"]
    ref_tokens, ref_logits = references["qwen3", kv]
    assert tokens == ref_tokens
    for n, ours, ref in zip(PROMPT_LENS, logits, ref_logits):
        assert (ours - ref).abs().max().item() <= (1e-5 if kv == "auto" else FP8_LOGIT_TOL), f"prompt of {n} tokens"
    assert decode["density"] == 1.0
    reuse = tiers.get("num_reuse_cache_blocks")
    if reuse is None:
        assert decode["comm_density"] is None, "no host tier"
    else:
        assert 0 < decode["comm_density"] <= 1
        assert (decode["reuse_rate"] is None) == (reuse == 0)
        if reuse == 32:
            assert decode["reuse_rate"] > 0.9, decode  # every host page is read every step: found from the 2nd on


def test_quest_reads_fewer_host_pages_and_the_reuse_cache_only_traffic(qwen3_dir, prompts):
    """Sparse QUEST (a 32-token budget per KV head) reads fewer host bytes than FULL; with a reuse
    cache it gives the same tokens and logits as without one and loads fewer bytes, the (page, KV
    head) reads it found in the cache being the ones it did not load."""
    opts = dict(max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=8, **HOST)
    quest = dict(sparse_policy="QUEST", sparse_token_budget=32, sparse_sink_tokens=16, sparse_recent_tokens=16)
    runs = {}
    for name, policy in (("full", {}), ("no-reuse", dict(quest, num_reuse_cache_blocks=0)),
                         ("reuse", dict(quest, num_reuse_cache_blocks=4))):
        with build_llm(qwen3_dir, **opts, **policy) as llm:
            got = generate_with_logits(llm, prompts[-3:], DECODE)
            runs[name] = got, llm.get_kv_cache_stats()["loaded_blocks"], llm.get_sparse_stats()["decode"]
    (_, full_loaded, _), (ref, loaded, off), (got, reuse_loaded, on) = runs["full"], runs["no-reuse"], runs["reuse"]
    assert 0 < off["comm_density"] < 1 and loaded < full_loaded
    assert 0 < off["density"] < 1
    assert got[0] == ref[0] and all((a - b).abs().max().item() <= 1e-5 for a, b in zip(got[1], ref[1]))
    assert 0 < on["reused_host_pages"] < on["read_host_pages"] and off["reuse_rate"] is None
    page_head_bytes = 2 * 16 * 32 * 4  # keys and values of one KV head of a 16-token page, head_dim 32, float32
    assert off["loaded_host_bytes"] - on["loaded_host_bytes"] == on["reused_host_pages"] * page_head_bytes
    assert reuse_loaded <= loaded


@pytest.mark.slow
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_tensor_parallel_2_with_host_tier_equals_1(llama_tied_dir, kv):
    """Each gloo rank keeps its shard of the KV heads in both tiers (with fp8, their scales too);
    TP=2 gives TP=1's tokens with the GPU tier capped (blocks spilled and read back)."""
    prompts = [random_prompt(n, seed=290 + n) for n in (40, 700, 1300)]
    opts = dict(max_model_len=1536, num_kvcache_blocks=4, enable_cpu_offload=True, num_cpu_kvcache_blocks=16,
                num_ring_slots=2, kv_cache_dtype=kv)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref = [o["token_ids"] for o in tp1.generate(prompts, greedy(100), use_tqdm=False)]
        assert tp1.get_kv_cache_stats()["spilled_blocks"] > 0
        heads = tp1.model_runner.cache.geometry.num_kv_heads
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        tokens = [o["token_ids"] for o in tp2.generate(prompts, greedy(100), use_tqdm=False)]
        cache = tp2.model_runner.cache
        assert cache.geometry.num_kv_heads == heads // 2
        assert cache.kv.shape[-2] == cache.host.k_host.shape[-2] == heads // 2
        if kv == "fp8":
            assert cache.kv_scales.shape[-1] == cache.host.k_host_scale.shape[-1] == heads // 2
    assert tokens == ref


# ---------------------------------------------------------------- block manager, unit level
def _seq(n, seed):
    from nanovllm.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

    return Sequence(random_prompt(n, seed=seed), SamplingParams(temperature=0.0), BLOCK)


def test_spills_coldest_full_blocks_never_the_first_or_the_written_one():
    from nanovllm.kvcache.block_manager import BlockManager

    bm = BlockManager(4, BLOCK, num_host_blocks=8)
    a = _seq(3 * BLOCK + 10, 1)  # 4 blocks: 3 full + 1 partial (the one a writes next)
    prefill(bm, a)
    assert bm.take_moves() == [] and all(g >= 0 for g in a.block_table), "4 free GPU blocks: no spill"
    b = _seq(2 * BLOCK, 2)
    bm.allocate(b)
    assert bm.ensure_writable(b, 2 * BLOCK) == 2 * BLOCK
    spills = bm.take_moves()
    assert all(move.to_host for move in spills)
    spills = [(move.gpu, move.host) for move in spills]
    assert [h for h in a.host_block_table if h >= 0] == [h for _, h in spills], "spilled in order"
    assert [g >= 0 for g in a.block_table] == [True, False, False, True], \
        "a's full blocks 1 and 2 went to the host, coldest (first full) first; block 0 and the partial one stayed"
    assert [gpu for gpu, _ in spills] == [b.block_table[0], b.block_table[1]], "b writes into the freed blocks"
    b.num_computed_tokens = 2 * BLOCK
    bm.commit(b)
    c = _seq(BLOCK, 3)
    assert not bm.can_allocate(c), "a GPU tier of 4 blocks keeps 2 sequences live"
    assert bm.usage()["spilled_blocks"] == 2
    for seq in (a, b):
        bm.deallocate(seq)
    assert bm.num_free_blocks == 12 and bm.usage()["gpu_blocks_used"] == bm.usage()["host_blocks_used"] == 0


def test_spill_moves_a_shared_block_for_every_sharer_and_keeps_its_registration():
    from nanovllm.kvcache.block_manager import BlockManager

    bm = BlockManager(6, BLOCK, num_host_blocks=8)
    a = _seq(3 * BLOCK, 3)
    prefill(bm, a)
    from nanovllm.sequence import Sequence

    b = Sequence(a.token_ids[:2 * BLOCK] + [5] * 10, a.sampling_params, BLOCK)
    bm.allocate(b)
    assert b.num_cached_tokens == 2 * BLOCK and b.block_table[1] == a.block_table[1]
    # a's block 2 is the coldest (b's hit on block 1 touched it); force two spills
    assert bm.tiers.spill_coldest() and bm.tiers.spill_coldest()
    assert [move.gpu for move in bm.take_moves()] == [a.block_table[0] + 2, a.block_table[0] + 1]
    assert a.block_table[1] == b.block_table[1] == -1
    assert a.host_block_table[1] == b.host_block_table[1] >= 0
    c = Sequence(a.token_ids[:2 * BLOCK] + [6] * 3, a.sampling_params, BLOCK)
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 2 * BLOCK and c.host_block_table[1] == a.host_block_table[1]


def test_admission_counts_both_tiers_and_the_live_limit():
    from nanovllm.kvcache.block_manager import BlockManager

    bm = BlockManager(4, BLOCK, num_host_blocks=4)  # 8 blocks, 2 live sequences
    a, b, c = _seq(5 * BLOCK, 4), _seq(3 * BLOCK - 1, 5), _seq(10, 6)
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert not bm.can_allocate(_seq(3 * BLOCK + 1, 7)), "5 reserved + 4 > 8"
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert not bm.can_allocate(c), "a GPU tier of 4 blocks keeps 2 sequences live"
    bm.deallocate(a)
    assert bm.can_allocate(c)


# ---------------------------------------------------------------- attention pipeline, unit level
HEADS_Q, HEADS_KV, DIM, LAYERS = 4, 2, 32, 2


def _pipeline(num_gpu_blocks=6, num_host_blocks=6, slots=2, policy=None, kv="auto"):
    """A TieredAttention over both tiers filled with random keys and values (fp8: quantized as the
    store quantizes, with their scales)."""
    from nanovllm.kvcache.host_tier import HostTier
    from nanovllm.kvcache.tiered_attention import TieredAttention
    from nanovllm.kvcache.tier_rows import TierRows
    from nanovllm.ops.kv_quant import quantize_ref
    from nanovllm.sparse import FullAttentionPolicy, SparseStats

    gen = torch.Generator().manual_seed(0)
    layout = TierRows(LAYERS, num_gpu_blocks, 0)
    dtype = torch.float32 if kv == "auto" else torch.float8_e4m3fn
    rows = torch.randn(2, layout.total, BLOCK, HEADS_KV, DIM, generator=gen)
    host = HostTier(LAYERS, BLOCK, HEADS_KV, DIM, dtype, torch.device("cpu"), num_host_blocks, slots,
                    scaled=kv != "auto")
    host_rows = [torch.randn(host.k_host.shape, generator=gen) for _ in range(2)]
    scale_rows = None
    if kv != "auto":
        rows, scale_rows = quantize_ref(rows, dtype)[:2]
        for x, cache, scales in zip(host_rows, (host.k_host, host.v_host), (host.k_host_scale, host.v_host_scale)):
            stored, scale, _ = quantize_ref(x, dtype)
            scales.copy_(scale)
            cache.view(torch.uint8).copy_(stored.view(torch.uint8))
    else:
        host.k_host.copy_(host_rows[0])
        host.v_host.copy_(host_rows[1])
    attention = TieredAttention(policy or FullAttentionPolicy(DIM ** -0.5), SparseStats(), DIM ** -0.5)
    attention.bind(rows, layout, host, scale_rows=scale_rows)
    return attention, host


def _full_context(attention, host, layer, gpu_table, host_table, n):
    """Keys and values ``[n, Hkv, D]`` (float32, an fp8 tier's dequantized) of the blocks of both tiers."""
    from nanovllm.ops.kv_quant import dequantize

    def block(which, g, h):
        cache, scales = ((attention.k_cache, attention.k_scales), (attention.v_cache, attention.v_scales))[which]
        if g >= 0:
            return dequantize(cache[layer, g], None if scales is None else scales[layer, g], torch.float32)
        host_scales = (host.k_host_scale, host.v_host_scale)[which]
        return dequantize((host.k_host, host.v_host)[which][layer, h], None if host_scales is None
                          else host_scales[layer, h], torch.float32)

    return tuple(torch.cat([block(which, g, h) for g, h in zip(gpu_table, host_table)])[:n] for which in (0, 1))


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_spill_and_load_back_move_the_bits_and_scales_of_every_layer(kv):
    from nanovllm.kvcache.eviction import BlockMove

    attention, host = _pipeline(kv=kv)
    gpu = [attention.k_cache, attention.v_cache] + ([] if kv == "auto" else [attention.k_scales, attention.v_scales])
    hosts = [host.k_host, host.v_host] + ([] if kv == "auto" else [host.k_host_scale, host.v_host_scale])
    before = [t[:, 2].clone() for t in gpu]
    scales = None if kv == "auto" else (attention.k_scales, attention.v_scales)
    host.move([BlockMove(gpu=2, host=4, to_host=True)], attention.k_cache, attention.v_cache, scales)
    host.move([BlockMove(gpu=5, host=4, to_host=False)], attention.k_cache, attention.v_cache, scales)
    for on_host, on_gpu, want in zip(hosts, gpu, before):
        assert torch.equal(on_host[:, 4].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(on_gpu[:, 5].view(torch.uint8), want.view(torch.uint8))
    assert host.bytes_h2d == LAYERS * host.layer_block_bytes  # the load back; the spill's bits are compared above
    assert host.layer_block_bytes == 2 * BLOCK * HEADS_KV * (DIM * (4 if kv == "auto" else 1) + (kv != "auto") * 4)


@pytest.mark.parametrize("slots", [2, 4, 8], ids=["groups-of-1", "groups-of-2", "one-group"])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_decode_over_both_tiers_equals_the_reference(kv, slots):
    """Three rows' host blocks, 3 per layer, through rings whose halves fold 1 (one launch per
    block), 2 or all 3 of a layer's loads at once."""
    from nanovllm.ops import decode_attention_ref
    from nanovllm.kvcache.context import Context, reset_context, set_context

    attention, host = _pipeline(slots=slots, kv=kv)
    tables = [([0, -1, -1, 2], [-1, 3, 0, -1], 3 * BLOCK + 7), ([1, -1, 4], [-1, 5, -1], 2 * BLOCK + 100),
              ([5], [-1], 9)]
    q = torch.randn(3, HEADS_Q, DIM)
    ctx = Context(is_prefill=False, host_loads=[(row, h) for row, (_, hosts, _) in enumerate(tables)
                                                for h in hosts if h >= 0])
    ctx.slot_mapping = torch.full((3,), -1, dtype=torch.int64)
    ctx.block_tables = torch.tensor([[g for g in gpus if g >= 0] + [-1] * (4 - sum(g >= 0 for g in gpus))
                                     for gpus, _, _ in tables], dtype=torch.int32)
    ctx.context_lens = torch.tensor([n - sum(h >= 0 for h in hosts) * BLOCK for _, hosts, n in tables],
                                    dtype=torch.int32)
    set_context(ctx)
    attention.begin_step(ctx)
    try:
        for layer in range(LAYERS):
            out = attention.forward(layer, q, torch.zeros(3, HEADS_KV, DIM), torch.zeros(3, HEADS_KV, DIM))
            for row, (gpus, hosts, n) in enumerate(tables):
                k, v = _full_context(attention, host, layer, gpus, hosts, n)
                ref = decode_attention_ref(q[row:row + 1], k.view(1, n, HEADS_KV, DIM), v.view(1, n, HEADS_KV, DIM),
                                           torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                                           DIM ** -0.5)
                assert (out[row] - ref[0]).abs().max() <= 1e-5, (layer, row)
    finally:
        reset_context()
    ring = attention.ring
    assert host.bytes_h2d == LAYERS * 3 * host.layer_block_bytes and ring.consumed == len(ring.groups), \
        "one plan across layers"
    assert len(ring.groups) == LAYERS * -(-3 // (slots // 2)), "groups of half the ring"


@pytest.mark.parametrize("segment", ["whole", "block"])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_prefill_gathers_a_prefix_from_both_tiers(kv, segment, monkeypatch):
    """The prefix from both tiers (fp8: dequantized with its scales); the chunk stored in the GPU tier
    first, and attended to as stored (fp8: quantized once, by the store, and read back dequantized).
    With segments of one block, the prefix is read a block at a time and its host block once."""
    import importlib

    from nanovllm.ops import prefill_attention_ref
    from nanovllm.ops.kv_quant import quantize_ref
    from nanovllm.kvcache.context import Context, PrefixGather, reset_context, set_context

    attention, host = _pipeline(kv=kv)
    quantized = []  # rows of each quantization, by every module of the package
    for module in [m for name, m in sys.modules.items() if name.startswith("nanovllm")]:
        if getattr(module, "quantize_ref", None) is quantize_ref:
            monkeypatch.setattr(module, "quantize_ref",
                                lambda x, *args: quantized.append(x.shape[0]) or quantize_ref(x, *args))
    if segment == "block":
        monkeypatch.setattr(importlib.import_module("nanovllm.ops.prefill_attention"), "PREFIX_SEGMENT_BYTES", 1)
    read = []
    monkeypatch.setattr(host, "read_blocks", lambda layer, blocks, *args, f=host.read_blocks: read.append(blocks)
                        or f(layer, blocks, *args))
    gpus, hosts, prefix, new = [0, -1, 3], [-1, 2, -1], 2 * BLOCK + 30, 50  # chunk continues block 2
    q, k, v = torch.randn(new, HEADS_Q, DIM), torch.randn(new, HEADS_KV, DIM), torch.randn(new, HEADS_KV, DIM)
    slots = torch.arange(prefix, prefix + new) % BLOCK + 3 * BLOCK
    gather = PrefixGather(prefix, [(0, 0), (2, 3)], [(1, 2)])
    ctx = Context(is_prefill=True, seqlens_q=[new], seqlens_k=[prefix + new], slot_mapping=slots,
                  block_tables=torch.tensor([gpus], dtype=torch.int32), prefix_gathers={0: gather})
    set_context(ctx)
    try:
        out = attention.forward(1, q, k, v)
    finally:
        reset_context()
    k_all, v_all = _full_context(attention, host, 1, gpus, hosts, prefix + new)
    if kv == "auto":
        assert torch.equal(k_all[prefix:], k), "the chunk was stored in the GPU tier first"
    else:
        assert (k_all[prefix:] - k).abs().max() <= k.abs().amax(-1, keepdim=True).max() / 16, "stored, quantized"
    ref = prefill_attention_ref(q, k_all[prefix:], v_all[prefix:], [new], [prefix + new], DIM ** -0.5,
                                prefixes={0: (k_all[:prefix], v_all[:prefix])})
    assert (out - ref).abs().max() <= 1e-5
    assert quantized == ([] if kv == "auto" else [new, new]), "the chunk's keys and values: quantized once"
    assert attention.stats.to_dict(True, True)["prefill"]["loaded_host_bytes"] == host.layer_block_bytes
    assert read == ([[], [(0, 2)], []] if segment == "block" else [[(1, 2)]]), "segments of a block: block 1 alone"
