"""Sliding-window attention end to end against transformers (CPU, float32).

A tiny random ``MistralForCausalLM`` (window of 300 tokens in every layer: the window's edge falls
inside the 256-token KV blocks; GQA 2:1) gives transformers' greedy tokens and logits within 1e-4
for prompts 2-3x the window over 64 generated tokens: GPU tier only, with prefix-cache hits, with
chunked prefill, with the host tier and the GPU tier at ~30% of the KV, with QUEST (its budget
covering the window, and made to choose inside it), with XATTN_BSA at threshold 1.0 and with
tensor parallelism over gloo. A Qwen2 config mixing full-attention and windowed layers does too.
Decode reads (statistics) correspond to the window, not the context, and blocks before the
window of a running sequence are released.
"""
import pytest
import torch

from _util import SLIDING_WINDOW, build_llm, generate_with_logits, greedy, random_prompt
from nanovllm.kvcache.window import window_start, window_table_width

BLOCK = 256
PROMPT_LENS = (700, 900, 90)  # 2.3 and 3 windows, and one inside its window
DECODE = 64
LOGITS_ATOL = 1e-4
BATCH_BLOCKS = sum(-(-(n + DECODE) // BLOCK) for n in PROMPT_LENS)  # 8: the batch's KV without releases
HOST = dict(enable_cpu_offload=True, num_cpu_kvcache_blocks=16, num_ring_slots=2)


def hf_greedy_with_logits(model_dir, prompts, max_new_tokens):
    """transformers' greedy tokens and float32 logits ``[steps, vocab]`` of each prompt."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=3,
                              output_logits=True, return_dict_in_generate=True)
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), generation_config=config)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.stack(out.logits)[:, 0].float())
    return tokens, logits


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=400 + n) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(mistral_dir, prompts):
    return hf_greedy_with_logits(mistral_dir, prompts, DECODE)


def assert_matches(got, ref, lens=PROMPT_LENS):
    tokens, logits = got
    assert tokens == ref[0]
    for n, ours, theirs in zip(lens, logits, ref[1]):
        assert ours.shape == theirs.shape
        diff = (ours - theirs).abs().max().item()
        assert diff <= LOGITS_ATOL, f"prompt of {n} tokens: max |logits - transformers| = {diff:.3g}"


def assert_nothing_held(llm):
    stats = llm.get_kv_cache_stats()
    assert stats["gpu_blocks_used"] == stats["host_blocks_used"] == 0, stats


# ---------------------------------------------------------------- the model's windows
def test_the_window_travels_from_the_config_to_every_layer_spec(mistral_dir, qwen2_mixed_dir):
    with build_llm(mistral_dir, max_model_len=2048) as llm:
        cache = llm.model_runner.cache
        assert [spec.sliding_window for spec in cache.specs] == [SLIDING_WINDOW] * 2
        assert cache.release_window == SLIDING_WINDOW and llm.scheduler.block_manager.release_window == SLIDING_WINDOW
    with build_llm(qwen2_mixed_dir, max_model_len=2048) as llm:
        cache = llm.model_runner.cache
        assert [spec.sliding_window for spec in cache.specs] == [None, SLIDING_WINDOW, SLIDING_WINDOW]
        assert cache.release_window is None, "a full-attention layer sees every block"
    with build_llm(mistral_dir, max_model_len=SLIDING_WINDOW) as llm:  # the window hides nothing
        assert [spec.sliding_window for spec in llm.model_runner.cache.specs] == [None, None]


def test_layer_windows_of_hf_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from nanovllm.models.sliding_window import layer_sliding_windows

    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=4096), 32768) == [4096] * 3
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=None), 32768) == [None] * 3
    assert layer_sliding_windows(LlamaConfig(num_hidden_layers=2), 4096) == [None] * 2
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=512, max_window_layers=2)
    assert layer_sliding_windows(qwen2, 4096) == [None, None, 512, 512]
    assert layer_sliding_windows(Qwen2Config(num_hidden_layers=2, sliding_window=512), 4096) == [None, None], \
        "use_sliding_window off"
    bad = MistralConfig(num_hidden_layers=1)
    bad.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1 or None, got 0"):
        layer_sliding_windows(bad, 4096)


# ---------------------------------------------------------------- against transformers
def test_gpu_tier_and_prefix_hits_match_transformers(mistral_dir, prompts, reference):
    """GPU tier only; then the same prompts again, reversed: their released blocks were kept in the
    prefix cache, so the second run hits them (and must give the same tokens and logits)."""
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=16) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), reference)
        first = llm.get_kv_cache_stats()
        assert first["released_blocks"] > 0 and first["prefix_cache_hit_tokens"] == 0
        assert_nothing_held(llm)
        tokens, logits = generate_with_logits(llm, prompts[::-1], DECODE)
        assert_matches((tokens[::-1], logits[::-1]), reference)
        assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] >= (2 + 3) * BLOCK, "all full prompt blocks"


def test_chunked_prefill_matches_transformers(mistral_dir, prompts, reference):
    """Chunks of 128 tokens: each chunk attends to the part of its prefix the window shows."""
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=16, max_num_batched_tokens=128) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), reference)


@pytest.mark.parametrize("ring_slots", [2, None], ids=["block-by-block", "grouped"])
def test_host_tier_with_the_gpu_tier_at_30_percent_matches_transformers(mistral_dir, prompts, reference,
                                                                        ring_slots):
    """2 GPU blocks of the batch's 8 (25%): window blocks are spilled and read back through the ring
    (decode) or gathered from both tiers (prefill chunks); a second run, reversed, gives the same.
    With 2 ring slots each block is folded alone; with the default ring a layer's blocks are
    folded together, a window's first block from its window start.
    (Its prompts find no cached prefix: their first blocks, never spilled, were released on the
    small GPU tier and their memory reused.)"""
    gpu_blocks = round(0.3 * BATCH_BLOCKS)
    host = {**HOST, "num_ring_slots": ring_slots}
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=gpu_blocks, **host) as llm:
        slots = llm.get_kv_cache_stats()["ring_slots"]
        assert slots == ring_slots if ring_slots else slots // 2 >= BATCH_BLOCKS, "a half holds a layer's blocks"
        assert_matches(generate_with_logits(llm, prompts, DECODE), reference)
        stats = llm.get_kv_cache_stats()
        assert stats["spilled_blocks"] > 0 and stats["loaded_blocks"] > 0, stats
        assert_nothing_held(llm)
        tokens, logits = generate_with_logits(llm, prompts[::-1], DECODE)
        assert_matches((tokens[::-1], logits[::-1]), reference)


@pytest.mark.parametrize("tiers", [dict(num_kvcache_blocks=16), dict(num_kvcache_blocks=2, **HOST)],
                         ids=["gpu-only", "host-tier"])
def test_quest_reads_the_whole_window_and_matches_transformers(mistral_dir, prompts, reference, tiers, caplog):
    """QUEST does not choose pages inside a sliding window: it says so once and every layer reads
    its window (read in place or through the ring), so the result is transformers'."""
    with caplog.at_level("WARNING", logger="nanovllm"):
        llm = build_llm(mistral_dir, max_model_len=1024, sparse_policy="QUEST", sparse_token_budget=64, **tiers)
    with llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), reference)
    assert "choosing pages inside a window is not supported" in caplog.text


def test_xattn_at_threshold_1_with_a_window_matches_transformers(mistral_dir, prompts, reference):
    """XATTN_BSA keeps every block at threshold 1.0; its mask is intersected with the window and
    the block-sparse kernel masks the window's edge."""
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=16, sparse_policy="XATTN_BSA",
                   sparse_threshold=1.0, max_num_batched_tokens=512) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), reference)
        prefill = llm.get_sparse_stats()["prefill"]
    assert prefill["density"] == 1.0, "every block the window shows is kept"


@pytest.mark.slow
def test_tensor_parallel_2_matches_transformers(mistral_dir, prompts, reference):
    """Gloo TP=2: each rank its shard of the KV heads, the same windows; also with the host tier."""
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=16, tensor_parallel_size=2) as llm:
        tokens = [o["token_ids"] for o in llm.generate(prompts, greedy(DECODE), use_tqdm=False)]
    assert tokens == reference[0]
    with build_llm(mistral_dir, max_model_len=1024, num_kvcache_blocks=2, tensor_parallel_size=2, **HOST) as llm:
        tokens = [o["token_ids"] for o in llm.generate(prompts, greedy(DECODE), use_tqdm=False)]
        assert llm.get_kv_cache_stats()["spilled_blocks"] > 0
    assert tokens == reference[0]


def test_mixed_full_and_windowed_layers_match_transformers(qwen2_mixed_dir, prompts):
    """Qwen2 with use_sliding_window and max_window_layers=1: layer 0 reads every block, layers
    1-2 their windows (one step builds both kinds of reads); nothing is released; QUEST reads
    every page too (it does not choose inside windows)."""
    ref = hf_greedy_with_logits(qwen2_mixed_dir, prompts, DECODE)
    with build_llm(qwen2_mixed_dir, max_model_len=1024, num_kvcache_blocks=16) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), ref)
        assert llm.get_kv_cache_stats()["released_blocks"] == 0
    with build_llm(qwen2_mixed_dir, max_model_len=1024, num_kvcache_blocks=3, **HOST) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), ref)
        assert llm.get_kv_cache_stats()["loaded_blocks"] > 0
    with build_llm(qwen2_mixed_dir, max_model_len=1024, num_kvcache_blocks=16, sparse_policy="QUEST",
                   sparse_token_budget=64) as llm:
        assert_matches(generate_with_logits(llm, prompts, DECODE), ref)


# ---------------------------------------------------------------- reads and releases
@pytest.mark.parametrize("opts", [dict(num_kvcache_blocks=16), dict(num_kvcache_blocks=4, **HOST),
                                  dict(num_kvcache_blocks=16, sparse_policy="QUEST", sparse_token_budget=64)],
                         ids=["gpu-only", "host-tier", "quest"])
def test_decode_reads_correspond_to_the_window_not_the_context(mistral_dir, opts):
    """A context of 8 windows (2,400 tokens, 10 blocks): every decode step reads, per layer, the
    window's tokens (``read_tokens``) of the context's (``context_tokens``); with the host tier, the
    host blocks loaded per step are the 2-3 the window spans."""
    steps, prompt = 16, random_prompt(8 * SLIDING_WINDOW, seed=410)
    with build_llm(mistral_dir, max_model_len=4096, **opts) as llm:
        llm.generate([prompt], greedy(steps + 1), use_tqdm=False)
        decode = llm.get_sparse_stats()["decode"]
        kv = llm.get_kv_cache_stats()
    layers, most = 2, window_table_width(SLIDING_WINDOW, BLOCK, 4096)
    assert most == 3
    lengths = [len(prompt) + i + 1 for i in range(steps)]
    assert decode["context_tokens"] == layers * sum(lengths)
    assert decode["read_tokens"] == layers * sum(n - window_start(n - 1, SLIDING_WINDOW) for n in lengths)
    assert decode["density"] < 0.3
    if opts.get("enable_cpu_offload"):
        block_kv = 2 * BLOCK * 2 * 32 * 4  # one layer's keys and values of a block (2 KV heads x 32, fp32)
        assert decode["loaded_host_bytes"] <= steps * layers * most * block_kv, "host blocks in the window only"
        assert kv["spilled_blocks"] > 0


def test_blocks_before_the_window_are_released_and_stay_reusable(mistral_dir):
    """A 600-token prompt decoding 1,000 tokens: with releases it never holds more blocks than the
    window spans plus the one being written; without, it holds every block of its context. The
    outputs are the same, and the released blocks stay in the prefix cache for a later prompt."""
    prompt, steps = random_prompt(600, seed=420), 1000
    held = {}
    for release in (True, False):
        with build_llm(mistral_dir, max_model_len=2048, num_kvcache_blocks=16) as llm:
            manager = llm.scheduler.block_manager
            if not release:
                manager.release_window = None
            most, original = [0], llm.model_runner.run

            def run(seqs, is_prefill, *args, **kwargs):
                most[0] = max(most[0], manager.usage()["gpu_blocks_used"])
                return original(seqs, is_prefill, *args, **kwargs)

            llm.model_runner.run = run
            out = llm.generate([prompt], greedy(steps), use_tqdm=False)[0]["token_ids"]
            held[release] = most[0], out, llm.get_kv_cache_stats()
            if release:
                again = llm.generate([prompt + [7]], greedy(1), use_tqdm=False)[0]
                assert again["num_cached_tokens"] == 2 * BLOCK, "the prompt's full blocks, released, still cached"
    (with_release, out_a, stats_a), (without, out_b, stats_b) = held[True], held[False]
    assert out_a == out_b
    assert with_release <= window_table_width(SLIDING_WINDOW, BLOCK, 2048) + 1
    assert without == -(-(600 + steps - 1) // BLOCK) == 7
    assert stats_a["released_blocks"] == (600 + steps - 1 - SLIDING_WINDOW + 1) // BLOCK
    assert stats_b["released_blocks"] == 0


def _seq(token_ids):
    from nanovllm.sampling_params import SamplingParams
    from nanovllm.sequence import Sequence

    return Sequence(token_ids, SamplingParams(temperature=0.0), BLOCK)


def test_block_manager_releases_only_blocks_no_query_sees_and_keeps_them_cached():
    """A sequence at its next query position c releases the blocks wholly before c - W + 1, in
    either tier, once they are committed; a block another sequence shares stays held; released
    blocks keep their registration (a later prompt hits them) until their memory is reused; the
    sequence's tables hold RELEASED there, and freeing it frees the rest exactly once."""
    from nanovllm.kvcache.block_manager import RELEASED, BlockManager

    bm = BlockManager(8, BLOCK, num_host_blocks=4, release_window=SLIDING_WINDOW)
    prompt = random_prompt(3 * BLOCK + 60, seed=430)
    a = _seq(prompt)
    bm.allocate(a)
    assert bm.ensure_writable(a, 2 * BLOCK) == 2 * BLOCK
    a.num_computed_tokens = 2 * BLOCK
    bm.commit(a)  # next query at 512: sees 213.., block 0 is partly visible
    assert RELEASED not in a.block_table
    b = _seq(prompt[:BLOCK] + [5] * 40)  # shares a's block 0
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == BLOCK
    shared = bm.gpu.blocks[a.block_table[0]]
    assert bm.ensure_writable(a, BLOCK + 60) == BLOCK + 60
    a.num_computed_tokens = len(a)
    bm.commit(a)  # next query at 828: sees 529.., blocks 0 and 1 wholly before it
    assert a.block_table[:2] == a.host_block_table[:2] == [RELEASED, RELEASED]
    assert bm.usage()["released_blocks"] == 2
    assert shared.ref_count == 1, "b still holds block 0"
    free = bm.gpu.num_free
    again = _seq(prompt[:2 * BLOCK] + [6] * 3)
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_cached_tokens == 2 * BLOCK, "the released block 1 is still registered"
    assert bm.gpu.num_free == free - 1
    for seq in (a, b, again):
        bm.deallocate(seq)
    assert bm.gpu.num_free == 8 and bm.host.num_free == 4 and bm.num_free_blocks == 12


def test_block_manager_without_a_window_releases_nothing():
    from nanovllm.kvcache.block_manager import RELEASED, BlockManager

    bm = BlockManager(8, BLOCK)
    a = _seq(random_prompt(3 * BLOCK + 10, seed=431))
    bm.allocate(a)
    bm.ensure_writable(a, len(a))
    a.num_computed_tokens = len(a)
    bm.commit(a)
    assert RELEASED not in a.block_table and bm.usage()["released_blocks"] == 0
