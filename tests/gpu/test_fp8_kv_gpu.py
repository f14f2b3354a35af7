"""FP8 KV on the GPU: each Triton kernel that writes or reads an fp8 cache against its torch
reference at realistic sizes (bf16 and fp16 queries, head_dim 64/128, GQA, 256-token blocks,
contexts up to 8K), and the engine with ``kv_cache_dtype="fp8"`` (CUDA graphs on, both tiers).

    python -m pytest tests/gpu/test_fp8_kv_gpu.py -q
"""
import importlib
import math

import pytest
import torch
from _gpu_util import assert_close

from nanovllm.ops import (decode_attend_merge, decode_attend_merge_ref, decode_attention, decode_attention_ref,
                          gather_host_pages, gather_host_pages_ref, prefill_attention, prefill_attention_ref,
                          store_kvcache, store_kvcache_ref)
from nanovllm.ops._triton import fp8_word_loads
from nanovllm.ops.kv_quant import dequantize
from nanovllm.ops.store_kv import KVScales

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
BLOCK_SIZE = 256
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_cache(contexts, heads_kv, dim, dtype, seed=0):
    """fp8 caches (every slot written by the store kernel, keys with an outlier channel), their
    scales, shuffled block tables (int32, -1 padded)."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    counts = [math.ceil(n / BLOCK_SIZE) for n in contexts]
    num_blocks = sum(counts) + 3
    n = num_blocks * BLOCK_SIZE
    keys = torch.randn(n, heads_kv, dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
    keys[:, :, 5] *= 40
    values = torch.randn(n, heads_kv, dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.empty(num_blocks, BLOCK_SIZE, heads_kv, dim, dtype=dtype, device=DEVICE)
                        for _ in range(2))
    scales = KVScales(*(torch.empty(num_blocks, BLOCK_SIZE, heads_kv, device=DEVICE) for _ in range(2)))
    store_kvcache(keys, values, k_cache, v_cache, torch.arange(n, device=DEVICE), scales)
    order = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(contexts), max(counts) + 2), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(counts):
        tables[b, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    return k_cache, v_cache, scales, tables.to(DEVICE)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("static", [None, (0.01, 0.02)], ids=["dynamic", "static"])
@pytest.mark.parametrize("wide", [False, True], ids=["randn", "wide-range"])
@pytest.mark.parametrize("return_stored", [False, True], ids=["store", "return-stored"])
def test_store_kernel_equals_reference(dtype, static, wide, return_stored):
    """Bit for bit, subnormals and signed zeros included (``wide``: elements down to 1e-12 of a
    row's amax); with ``return_stored`` the rows read back too (bf16, padding rows included), and
    the stored ones are the cache's rows dequantized."""
    g = torch.Generator(DEVICE).manual_seed(1)
    n, heads, dim = 3000, 8, 128
    slots = torch.randperm(40 * BLOCK_SIZE, device=DEVICE, generator=g)[:n]
    slots[::97] = -1
    key, value = (torch.randn(n, heads, dim, device=DEVICE, generator=g, dtype=torch.bfloat16) * 3 for _ in range(2))
    if wide:
        key = key * torch.logspace(-12, 0, dim, device=DEVICE, dtype=torch.bfloat16)
    got = []
    for store in (store_kvcache, store_kvcache_ref):
        caches = [torch.zeros(40, BLOCK_SIZE, heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
        scales = KVScales(*(torch.zeros(40, BLOCK_SIZE, heads, device=DEVICE) for _ in range(2)), static,
                          torch.zeros(1, dtype=torch.int64, device=DEVICE))
        stored = store(key, value, *caches, slots, scales, return_stored=return_stored)
        got.append((*(c.view(torch.uint8) for c in caches), *scales[:2], scales.saturated, *(stored or ())))
    assert len(got[0]) == len(got[1]) == (7 if return_stored else 5)
    for ours, ref in zip(*got):
        assert torch.equal(ours, ref), "IEEE division and explicit rounding: the reference's bits"
    assert (got[0][4].item() > 0) == (static is not None and dtype == torch.float8_e4m3fn)
    if return_stored:
        valid = slots >= 0
        block, offset = slots[valid] // BLOCK_SIZE, slots[valid] % BLOCK_SIZE
        for cache, scale, back in zip(caches, scales[:2], got[0][5:]):
            assert back.dtype == torch.bfloat16
            assert torch.equal(back[valid], dequantize(cache[block, offset], scale[block, offset], torch.bfloat16))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads_q, heads_kv, dim",
                         [(32, 8, 128), (16, 8, 64), (14, 2, 64), (8, 2, 90), (8, 2, 80), (16, 4, 256), (8, 8, 32)])
@pytest.mark.parametrize("per_head", [False, True], ids=["table", "per-head-tables"])
def test_decode_kernel_matches_reference(dtype, q_dtype, heads_q, heads_kv, dim, per_head):
    contexts = [1, 255, 256, 1000, 4097, 8192]
    k_cache, v_cache, scales, tables = _fp8_cache(contexts, heads_kv, dim, dtype)
    if per_head:
        tables = torch.stack([tables.roll(h, -1) if h else tables for h in range(heads_kv)], 1).contiguous()
        tables[:, :, -2:] = -1
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(contexts), heads_q, dim, device=DEVICE, dtype=q_dtype)
    kw = dict(return_lse=True, k_scale=scales.k_scale, v_scale=scales.v_scale)
    if per_head:  # each head's table reads its own blocks: the reference per head, on the dequantized cache
        out, lse = decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, **kw)
        want_out, want_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, dim ** -0.5, **kw)
    else:
        out, lse = decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, **kw)
        plain = [dequantize(c, s, torch.float32) for c, s in zip((k_cache, v_cache), scales[:2])]
        want_out, want_lse = decode_attention_ref(q.float(), *plain, tables, lens, dim ** -0.5, return_lse=True)
    assert_close(out, want_out.float())
    # a head whose table has no page of a row reads nothing: -inf in both (their difference is NaN)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite], rel=1e-3, atol=2e-2)


def test_values_are_read_as_words_where_rows_are_4_byte_aligned():
    """head_dim 90 (the decode test above) and an odd base (the ring-fold test below) take the fp8
    tile load instead."""
    cache = torch.zeros(4, BLOCK_SIZE, 8, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert fp8_word_loads(cache, 128)
    assert fp8_word_loads(cache[1:, :, 2:], 128)
    assert not fp8_word_loads(cache[..., :90], 90)
    assert not fp8_word_loads(cache.view(-1)[1:1 + 64 * 128].view(64, 1, 128), 128)
    assert not fp8_word_loads(cache.cpu(), 128)


@pytest.mark.parametrize("dtype", FP8)
def test_decode_kernel_with_window_starts_and_cuda_graph(dtype):
    contexts = [300, 5000, 8000]
    k_cache, v_cache, scales, tables = _fp8_cache(contexts, 8, 128, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1000, 7000], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(context_starts=starts, k_scale=scales.k_scale, v_scale=scales.v_scale)
    eager = decode_attention(q, k_cache, v_cache, tables, lens, 128 ** -0.5, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_attention(q, k_cache, v_cache, tables, lens, 128 ** -0.5, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert_close(eager, decode_attention_ref(q, k_cache, v_cache, tables, lens, 128 ** -0.5, **kw))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_keys", [256, 4096], ids=["one-part", "split"])
@pytest.mark.parametrize("layout", ["contiguous", "rows-from-5", "odd-base"])
def test_ring_fold_kernel_matches_reference(dtype, num_keys, layout):
    """``rows-from-5``: a view that starts 5 rows in (a ring half's later keys); ``odd-base``: the
    values copied to a buffer whose first byte is not 4-byte aligned, so the fp8 tile load runs."""
    k_cache, v_cache, scales, _ = _fp8_cache([num_keys + 256], 2, 128, dtype)
    first = 5 if layout == "rows-from-5" else 0
    k, v, k_scale, v_scale = (t[:num_keys // BLOCK_SIZE + 1].flatten(0, 1)[first:first + num_keys]
                              for t in (k_cache, v_cache, scales.k_scale, scales.v_scale))
    if layout == "odd-base":
        v = torch.empty(v.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(v.shape).copy_(v)
        assert not fp8_word_loads(v, 128)
    else:
        assert fp8_word_loads(v, 128)
    q = torch.randn(16, 128, device=DEVICE, dtype=torch.bfloat16)
    states = [(torch.randn(16, 128, device=DEVICE), torch.randn(16, device=DEVICE)) for _ in range(1)]
    states.append((states[0][0].clone(), states[0][1].clone()))
    decode_attend_merge(q, k, v, *states[0], 128 ** -0.5, k_scale, v_scale)
    decode_attend_merge_ref(q, k, v, *states[1], 128 ** -0.5, k_scale, v_scale)
    assert_close(states[0][0], states[1][0])
    assert_close(states[0][1], states[1][1], rel=1e-3, atol=2e-2)


def test_page_gather_from_pinned_host_moves_scales():
    k_cache, v_cache, scales, _ = _fp8_cache([2048], 8, 128, torch.float8_e4m3fn)
    page = 16
    src = [t.cpu().pin_memory().view(-1, page, *t.shape[2:]) for t in (k_cache, v_cache)]
    src_scales = tuple(s.cpu().pin_memory().view(-1, page, s.shape[2]) for s in scales[:2])
    ids = torch.randint(0, src[0].shape[0], (200,), device=DEVICE)
    heads = torch.randint(0, 8, (200,), device=DEVICE)
    dst_ids = torch.randperm(200, device=DEVICE)
    got = []
    for gather in (gather_host_pages, gather_host_pages_ref):
        dst = [torch.zeros(200, page, 8, 128, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
        dst_scales = tuple(torch.zeros(200, page, 8, device=DEVICE) for _ in range(2))
        if gather is gather_host_pages:
            gather(*src, ids, heads, *dst, dst_ids, src_scales, dst_scales)
        else:
            gather(*src, ids, heads, *dst, dst_ids)
            gather(*(s.unsqueeze(-1) for s in src_scales), ids, heads, *(s.unsqueeze(-1) for s in dst_scales), dst_ids)
        torch.cuda.synchronize()
        got.append((*(d.view(torch.uint8) for d in dst), *dst_scales))
    for ours, ref in zip(*got):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("segment", ["whole", "512"])
@pytest.mark.parametrize("window", [None, 1000])
def test_prefill_over_an_fp8_prefix_matches_reference(window, segment, monkeypatch):
    """(Segments of 512 tokens: the prefix gathered, dequantized and attended a segment at a time.)"""
    if segment != "whole":
        monkeypatch.setattr(importlib.import_module("nanovllm.ops.prefill_attention"), "PREFIX_SEGMENT_BYTES",
                            512 * 8 * 128 * 2)
    k_cache, v_cache, scales, tables = _fp8_cache([3000, 700], 8, 128, torch.float8_e4m3fn)
    seqlens_q, seqlens_k = [500, 700], [3000, 700]
    q = torch.randn(1200, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1200, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(sliding_window=window, k_scale=scales.k_scale, v_scale=scales.v_scale)
    got = prefill_attention(q, k, v, seqlens_q, seqlens_k, 128 ** -0.5, k_cache, v_cache, tables, **kw)
    want = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 128 ** -0.5, k_cache, v_cache, tables, **kw)
    assert_close(got, want)


NEAR_TIE = 0.1
"""A bf16 parting of two runs is allowed where the two candidates' logits are this close (as
tests/gpu/test_tiers_gpu.py)."""


def test_engine_fp8_kv_tiers_and_graphs_give_gpu_only_tokens():
    """A random Qwen2.5-0.5B-shaped model (2 KV heads of 64) in bf16 with fp8 KV: GPU-only with CUDA
    graphs, and the host tier holding all but a few blocks (eager), give the same greedy tokens (a
    parting only at a bf16 near-tie), and the stats say fp8, nothing saturated, and about twice the
    GPU tier's tokens of the bf16 cache in the same memory."""
    from nanovllm import LLM, SamplingParams
    from tools.divergence import parting
    from tools.random_checkpoint import cached_random_checkpoint

    model = cached_random_checkpoint("qwen2.5-0.5b")
    prompts = [torch.randint(1, 30000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5000, 9000)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(model, max_model_len=16384, gpu_memory_utilization=0.5) as llm:
        bf16_tokens = llm.get_kv_cache_stats()["gpu_tokens"]
    with LLM(model, kv_cache_dtype="fp8", max_model_len=16384, gpu_memory_utilization=0.5) as llm:
        reference = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_kv_cache_stats()
    assert stats["kv_cache_dtype"] == "fp8" and stats["saturated_values"] == 0
    assert stats["gpu_tokens"] >= 1.85 * bf16_tokens, (stats["gpu_tokens"], bf16_tokens)  # 128 / 68 = 1.88
    with LLM(model, kv_cache_dtype="fp8", max_model_len=16384, enable_cpu_offload=True, num_kvcache_blocks=4,
             num_cpu_kvcache_blocks=128, enforce_eager=True) as llm:
        tiered = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_kv_cache_stats()
        assert stats["spilled_blocks"] > 0 and stats["loaded_blocks"] > 0, stats
        for ours, theirs, prompt in zip(reference, tiered, prompts):
            p = parting(llm, prompt, ours, theirs)
            assert p is None or abs(p["logit_gap"]) < NEAR_TIE, p
