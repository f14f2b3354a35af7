"""FP8 KV cache (``kv_cache_dtype``): the quantization the store writes, every read path against its
reference over the dequantized cache (CPU, and the Triton kernels under the interpreter), the
option, the spec and sizing, a checkpoint's static scales, chunking and prefix hits, and SmolLM2's
teacher-forced top-1 agreement with float32 KV.

The interpreter must be switched on before Triton is imported, so the ``test_interpreted_*``
tests run in a child pytest (``test_kernels_under_the_interpreter``).
"""
import copy
import math
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _interpreter import interpreted_only, run_interpreted_tests
from _util import build_llm, generate_with_logits, greedy, random_prompt, token_ids
from benchmarks.key_offset_sources import hf_key_means, hf_logits, quantized_logits
from benchmarks.kv_dtype_agreement import teacher_forced
from nanovllm.kvcache import sizing
from nanovllm.kvcache.spec import LayerKVSpec
from nanovllm.ops import (decode_attend_merge, decode_attend_merge_ref, decode_attention, decode_attention_ref,
                          gather_host_pages, gather_host_pages_ref, prefill_attention, prefill_attention_ref,
                          store_kvcache, store_kvcache_ref)
from nanovllm.ops.kv_quant import MIN_SCALE, dequantize, fp8_mantissa_bits, fp8_max, quantize_ref
from nanovllm.ops.store_kv import KVScales

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HEADS_Q, HEADS_KV, DIM, BLOCK, NUM_BLOCKS = 8, 2, 64, 16, 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _stored_cache(dtype, seed=0, num_blocks=NUM_BLOCKS, heads=HEADS_KV, value_size=1.0):
    """An fp8 cache with every slot written by the store (keys with an outlier channel, values
    ``value_size`` times standard normal ones), and the same cache dequantized to float32."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * BLOCK
    keys = torch.randn(n, heads, DIM, generator=g)
    keys[:, :, 3] *= 30  # an outlier channel (Qwen2-family keys): dynamic scales follow it
    values = torch.randn(n, heads, DIM, generator=g) * value_size
    k_cache, v_cache = (torch.empty(num_blocks, BLOCK, heads, DIM, dtype=dtype) for _ in range(2))
    scales = KVScales(*(torch.empty(num_blocks, BLOCK, heads) for _ in range(2)))
    store_kvcache(keys, values, k_cache, v_cache, torch.arange(n), scales)
    plain = [dequantize(c, s, torch.float32) for c, s in zip((k_cache, v_cache), scales[:2])]
    return k_cache, v_cache, scales, plain


# ---- quantization and the store ----------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8)
def test_dynamic_scales_map_each_rows_amax_to_the_fp8_max(dtype):
    x = torch.randn(5, 3, DIM) * torch.logspace(-3, 3, 5)[:, None, None]
    x[2, 1] = 0.0
    stored, scale, saturated = quantize_ref(x, dtype)
    amax = x.abs().amax(-1)
    assert torch.equal(scale, (amax / fp8_max(dtype)).clamp(min=MIN_SCALE))
    assert int(saturated) == 0 and scale[2, 1] == MIN_SCALE and torch.equal(stored[2, 1].float(), torch.zeros(DIM))
    back = dequantize(stored, scale, torch.float32)
    assert torch.isfinite(back).all()
    # round to nearest: at most half a step of the top binade (2^-(M+1) of the row's amax)
    assert ((back - x).abs() <= amax[..., None] * 2.0 ** -(fp8_mantissa_bits(dtype) + 1)).all()
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0), "the largest element: to rounding"


def test_static_scales_saturate_and_count_what_they_clamp():
    x = torch.tensor([[[1.0, -2.0, 500.0, -900.0]]])
    stored, scale, saturated = quantize_ref(x, torch.float8_e4m3fn, static_scale=1.0)
    assert int(saturated) == 2 and stored.float().tolist() == [[[1.0, -2.0, 448.0, -448.0]]]
    assert torch.equal(scale, torch.ones(1, 1))


def _assert_read_back(stored, key, value, caches, scales, slots):
    """``stored`` (the store's ``return_stored``) holds each stored row as the cache holds it
    (dequantized with the scales written beside it), and every row, a padding one (slot -1)
    included, as quantized and dequantized by the reference."""
    valid = slots >= 0
    block, offset = slots[valid] // caches[0].shape[1], slots[valid] % caches[0].shape[1]
    for which, (x, cache, scale, back) in enumerate(zip((key, value), caches, scales[:2], stored)):
        assert back.dtype == x.dtype and back.shape == x.shape
        assert torch.equal(back[valid], dequantize(cache[block, offset], scale[block, offset], x.dtype))
        static = None if scales.static is None else scales.static[which]
        assert torch.equal(back, dequantize(*quantize_ref(x, cache.dtype, static)[:2], x.dtype))


@pytest.mark.parametrize("slots", [[0, 5, 17, 33, 63, 2], [0, 5, -1, 33, 63, 2]], ids=["dense", "padded"])
@pytest.mark.parametrize("static", [None, (0.002, 0.005)], ids=["dynamic", "static"])
def test_store_cpu_equals_reference(slots, static):
    g = torch.Generator().manual_seed(1)
    key, value = (torch.randn(len(slots), HEADS_KV, DIM, generator=g) for _ in range(2))
    slots = torch.tensor(slots)
    got = []
    for store in (store_kvcache, store_kvcache_ref):
        for return_stored in (False, True):
            caches = [torch.zeros(4, BLOCK, HEADS_KV, DIM, dtype=torch.float8_e4m3fn) for _ in range(2)]
            scales = KVScales(torch.zeros(4, BLOCK, HEADS_KV), torch.zeros(4, BLOCK, HEADS_KV), static,
                              torch.zeros(1, dtype=torch.int64))
            stored = store(key, value, *caches, slots, scales, return_stored=return_stored)
            assert (stored is None) != return_stored
            got.append((*(_bits(c) for c in caches), *scales[:2], scales.saturated))
        _assert_read_back(stored, key, value, caches, scales, slots)
    for ours in got[1:]:
        for a, b in zip(ours, got[0]):
            assert torch.equal(a, b)
    assert (got[0][4].item() > 0) == (static is not None), "tiny static scales clamp; dynamic ones never do"


@pytest.mark.parametrize("slots", [[0, 5, 17], [0, -1, 17]], ids=["dense", "padded"])
def test_store_of_another_cache_returns_the_cast_rows(slots):
    key, value = torch.randn(3, HEADS_KV, DIM), torch.randn(3, HEADS_KV, DIM)
    for store in (store_kvcache, store_kvcache_ref):
        caches = [torch.zeros(2, BLOCK, HEADS_KV, DIM, dtype=torch.bfloat16) for _ in range(2)]
        stored = store(key, value, *caches, torch.tensor(slots), return_stored=True)
        for x, back in zip((key, value), stored):
            assert back.dtype == torch.float32 and torch.equal(back, x.to(torch.bfloat16).float())
            assert not torch.equal(back, x), "rounded to bf16"


def test_scales_are_checked_against_the_cache_dtype():
    key = torch.randn(2, HEADS_KV, DIM)
    fp8 = [torch.zeros(2, BLOCK, HEADS_KV, DIM, dtype=torch.float8_e4m3fn) for _ in range(2)]
    plain = [torch.zeros(2, BLOCK, HEADS_KV, DIM) for _ in range(2)]
    scales = KVScales(torch.zeros(2, BLOCK, HEADS_KV), torch.zeros(2, BLOCK, HEADS_KV))
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kvcache(key, key, *fp8, slots)
    with pytest.raises(ValueError, match="k_scale given for a torch.float32 cache"):
        store_kvcache(key, key, *plain, slots, scales)
    with pytest.raises(ValueError, match=r"k_scale must be float32 \(2, 16, 2\)"):
        store_kvcache(key, key, *fp8, slots, KVScales(torch.zeros(2, BLOCK, 1), torch.zeros(2, BLOCK, 1)))
    q = torch.randn(1, HEADS_Q, DIM)
    with pytest.raises(ValueError, match="needs k_scale"):
        decode_attention(q, *fp8, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1)


# ---- read paths against the references over the dequantized cache -------------------------

def _decode_cases(per_head: bool, starts: bool):
    tables = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7]], dtype=torch.int32)
    if per_head:
        tables = torch.stack([tables, tables.roll(1, -1)], 1)
    lens = torch.tensor([40, 20, 33], dtype=torch.int32)
    return tables, lens, torch.tensor([5, 0, 17], dtype=torch.int32) if starts else None


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True], ids=["table", "per-head-tables"])
@pytest.mark.parametrize("starts", [False, True], ids=["full", "window-starts"])
def test_decode_reads_the_dequantized_cache(dtype, per_head, starts):
    k_cache, v_cache, scales, (k_plain, v_plain) = _stored_cache(dtype)
    tables, lens, context_starts = _decode_cases(per_head, starts)
    q = torch.randn(3, HEADS_Q, DIM)
    want = decode_attention_ref(q, k_plain, v_plain, tables, lens, 0.125, True, context_starts)
    for decode in (decode_attention, decode_attention_ref):
        out, lse = decode(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True, context_starts=context_starts,
                          k_scale=scales.k_scale, v_scale=scales.v_scale)
        torch.testing.assert_close(out, want[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse, want[1], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8)
def test_ring_fold_reads_the_dequantized_block(dtype):
    k_cache, v_cache, scales, (k_plain, v_plain) = _stored_cache(dtype)
    q = torch.randn(HEADS_Q, DIM)
    out0, lse0 = torch.randn(HEADS_Q, DIM), torch.randn(HEADS_Q)
    want_out, want_lse = out0.clone(), lse0.clone()
    decode_attend_merge_ref(q, k_plain[2], v_plain[2], want_out, want_lse, 0.125)
    out, lse = out0.clone(), lse0.clone()
    decode_attend_merge(q, k_cache[2], v_cache[2], out, lse, 0.125, scales.k_scale[2], scales.v_scale[2])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_page_gather_moves_each_pages_scales():
    k_src, v_src, scales, _ = _stored_cache(torch.float8_e4m3fn)
    dst = [torch.zeros(3, BLOCK, HEADS_KV, DIM, dtype=torch.float8_e4m3fn) for _ in range(2)]
    dst_scales = (torch.zeros(3, BLOCK, HEADS_KV), torch.zeros(3, BLOCK, HEADS_KV))
    src, heads, to = torch.tensor([4, -1, 6]), torch.tensor([1, 0, 0]), torch.tensor([0, 1, 2])
    gather_host_pages(k_src, v_src, src, heads, *dst, to, scales[:2], dst_scales)
    assert torch.equal(_bits(dst[0][0, :, 1]), _bits(k_src[4, :, 1])) and torch.equal(_bits(dst[1][2, :, 0]),
                                                                                    _bits(v_src[6, :, 0]))
    assert torch.equal(dst_scales[0][0, :, 1], scales.k_scale[4, :, 1])
    assert torch.equal(dst_scales[1][2, :, 0], scales.v_scale[6, :, 0])
    assert not dst_scales[0][1].any() and not dst_scales[0][0, :, 0].any(), "a -1 entry and other heads untouched"
    with pytest.raises(ValueError, match="src_scales and dst_scales go together"):
        gather_host_pages(k_src, v_src, src, heads, *dst, to, scales[:2])


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_over_a_cached_fp8_prefix_reads_it_dequantized(window):
    k_cache, v_cache, scales, (k_plain, v_plain) = _stored_cache(torch.float8_e4m3fn)
    seqlens_q, seqlens_k = [5, 7], [37, 7]  # a 32-token prefix, and a sequence without one
    q, k, v = torch.randn(12, HEADS_Q, DIM), torch.randn(12, HEADS_KV, DIM), torch.randn(12, HEADS_KV, DIM)
    tables = torch.tensor([[3, 1, 6], [0, 0, 0]], dtype=torch.int32)
    want = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 0.125, k_plain, v_plain, tables,
                                 sliding_window=window)
    for prefill in (prefill_attention, prefill_attention_ref):
        got = prefill(q, k, v, seqlens_q, seqlens_k, 0.125, k_cache, v_cache, tables, sliding_window=window,
                      k_scale=scales.k_scale, v_scale=scales.v_scale)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


# ---- the Triton kernels, under the interpreter ---------------------------------------------

def test_kernels_under_the_interpreter():
    run_interpreted_tests(__file__, min_passed=56)


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("static", [None, (1e-5, 2e-5)], ids=["dynamic", "static"])  # static: beyond e5m2's range too
@pytest.mark.parametrize("return_stored", [False, True], ids=["store", "return-stored"])
def test_interpreted_store_equals_reference_bit_for_bit(dtype, static, return_stored):
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 5, -1, 33, 63, 2, 40])
    key, value = (torch.randn(7, 3, 40, generator=g) * 4 for _ in range(2))  # 3 heads, head_dim 40: padded tiles
    got = []
    for store in (store_kvcache, store_kvcache_ref):
        caches = [torch.zeros(4, BLOCK, 3, 40, dtype=dtype) for _ in range(2)]
        scales = KVScales(torch.zeros(4, BLOCK, 3), torch.zeros(4, BLOCK, 3), static, torch.zeros(1, dtype=torch.int64))
        stored = store(key, value, *caches, slots, scales, return_stored=return_stored)
        got.append((*(_bits(c) for c in caches), *scales[:2], scales.saturated, *(stored or ())))
    assert len(got[0]) == len(got[1]) == (7 if return_stored else 5)
    for ours, ref in zip(*got):
        assert torch.equal(ours, ref)
    assert (got[0][4].item() > 0) == (static is not None)
    if return_stored:
        _assert_read_back(got[0][5:], key, value, caches, scales, slots)


@interpreted_only
def test_interpreted_store_of_another_cache_returns_the_rows_it_wrote():
    """The stored rows read back; the interpreter's bf16 cast need not round as torch's does, so
    the rows are compared with the cache, and with the input to bf16's resolution."""
    key, value = torch.randn(3, HEADS_KV, DIM), torch.randn(3, HEADS_KV, DIM)
    caches = [torch.zeros(2, BLOCK, HEADS_KV, DIM, dtype=torch.bfloat16) for _ in range(2)]
    stored = store_kvcache(key, value, *caches, torch.tensor([0, -1, 17]), return_stored=True)
    for x, cache, back in zip((key, value), caches, stored):
        assert back.dtype == torch.float32 and not torch.equal(back, x), "rounded to bf16"
        assert torch.equal(back[0], cache[0, 0].float()) and torch.equal(back[2], cache[1, 1].float())
        assert ((back - x).abs() <= x.abs() * 2.0 ** -7).all()
        assert not cache[0, 1:].any() and not cache[1, 2:].any(), "slot -1 is not written"


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
def test_interpreted_store_rounds_the_whole_fp8_range_as_torch(dtype):
    """Elements from the row's amax down to 1e-12 of it: normal values whose rounding carries into
    the exponent, subnormals, and zeros of either sign, the bits of torch's cast."""
    g = torch.Generator().manual_seed(3)
    key = torch.randn(64, 2, DIM, generator=g) * torch.logspace(-12, 0, DIM)
    key[:, :, 0] = 1.0
    value = -key.flip(-1)
    got = []
    for store in (store_kvcache, store_kvcache_ref):
        caches = [torch.zeros(4, BLOCK, 2, DIM, dtype=dtype) for _ in range(2)]
        scales = KVScales(torch.zeros(4, BLOCK, 2), torch.zeros(4, BLOCK, 2))
        store(key, value, *caches, torch.arange(64), scales)
        got.append([_bits(c) for c in caches])
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    subnormal = got[1][0] & 0x7F < (1 << (7 - fp8_mantissa_bits(dtype)))  # exponent bits all zero
    assert subnormal.float().mean() > 0.2, "the case covers subnormals"


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True], ids=["table", "per-head-tables"])
@pytest.mark.parametrize("starts, num_splits", [(False, None), (False, 3), (True, 2)])
def test_interpreted_decode_matches_reference(dtype, per_head, starts, num_splits):
    k_cache, v_cache, scales, _ = _stored_cache(dtype)
    tables, lens, context_starts = _decode_cases(per_head, starts)
    q = torch.randn(3, HEADS_Q, DIM)
    args = (q, k_cache, v_cache, tables, lens, 0.125)
    kwargs = dict(return_lse=True, context_starts=context_starts, k_scale=scales.k_scale, v_scale=scales.v_scale)
    out, lse = decode_attention(*args, num_splits=num_splits, **kwargs)
    want_out, want_lse = decode_attention_ref(*args, **kwargs)
    # float32 sums in another order (splits, the online softmax) differ by a few ulps of the values
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_keys", [BLOCK, 4 * 256], ids=["one-part", "split"])
def test_interpreted_ring_fold_matches_reference(dtype, num_keys):
    k_cache, v_cache, scales, _ = _stored_cache(dtype, num_blocks=num_keys // BLOCK, heads=1)
    k, v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    k_scale, v_scale = scales.k_scale.flatten(0, 1), scales.v_scale.flatten(0, 1)
    q = torch.randn(4, DIM)
    state = [(torch.randn(4, DIM), torch.randn(4)) for _ in range(2)]
    state[1] = (state[0][0].clone(), state[0][1].clone())
    decode_attend_merge(q, k, v, *state[0], 0.125, k_scale, v_scale)
    decode_attend_merge_ref(q, k, v, *state[1], 0.125, k_scale, v_scale)
    # float32 sums in another order (the kernel's online softmax over a split context) differ by a few ulps
    torch.testing.assert_close(state[0][0], state[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0][1], state[1][1], atol=2e-6, rtol=1e-5)


HALF_CASES = [(torch.float16, 1.0, 1.0), (torch.bfloat16, 1.0, 1.0), (torch.float16, 1e-6, 1.0),
              (torch.bfloat16, 1e-6, 1.0), (torch.bfloat16, 1.0, 1e6)]
HALF_IDS = ["float16", "bfloat16", "float16-tiny-values", "bfloat16-tiny-values", "bfloat16-query-past-float16"]


def _half_case(dtype, q_dtype, value_size, query_size, q_shape, num_blocks=NUM_BLOCKS):
    """A stored fp8 cache whose values are ``value_size`` times _stored_cache's, and a 16-bit query
    of ``q_shape`` times ``query_size`` (past float16's range at 1e6), with the dequantized cache."""
    k_cache, v_cache, scales, (k_plain, v_plain) = _stored_cache(dtype, num_blocks=num_blocks, value_size=value_size)
    q = (torch.randn(q_shape, generator=torch.Generator().manual_seed(5)) * query_size).to(q_dtype)
    return q, k_cache, v_cache, scales.k_scale, scales.v_scale, k_plain, v_plain


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype, value_size, query_size", HALF_CASES, ids=HALF_IDS)
def test_interpreted_half_query_decode_matches_reference(dtype, q_dtype, value_size, query_size):
    """A 16-bit query over an fp8 cache: float16 dots (``half_query``), each row's weights
    ``p * v_scale`` over the row's largest. Values a million times smaller would leave every weight
    below float16's smallest subnormal without that normalisation (the output would be zeros), and a
    bfloat16 query of 1e6 past float16's range without the query's power of two."""
    q, k_cache, v_cache, k_scale, v_scale, k_plain, v_plain = _half_case(dtype, q_dtype, value_size, query_size,
                                                                         (3, HEADS_Q, DIM))
    tables, lens, _ = _decode_cases(True, False)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True, num_splits=2,
                                k_scale=k_scale, v_scale=v_scale)
    want_out, want_lse = decode_attention_ref(q.float(), k_plain, v_plain, tables, lens, 0.125, True)
    assert out.abs().max() > 0.1 * want_out.abs().max() > 0
    # the scores are exact (16-bit queries and fp8 keys convert to float16 exactly); the float16
    # probabilities round to 11 bits
    torch.testing.assert_close(out / value_size, want_out / value_size, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
def test_interpreted_half_query_decode_in_splits_of_full_tiles(dtype):
    """Contexts of several 128-token tiles in two splits (merged by LSE), per-KV-head tables with
    -1 entries (blocks a head does not read), a bfloat16 query."""
    k_cache, v_cache, scales, _ = _stored_cache(dtype, num_blocks=48)
    g = torch.Generator().manual_seed(6)
    tables = torch.stack([torch.randperm(48, generator=g)[:44].view(1, 44).int() for _ in range(3 * HEADS_KV)])
    tables = tables.view(3, HEADS_KV, 44)
    tables[0, 1, 5:9] = -1
    tables[2, 0, 20:] = -1
    lens = torch.tensor([700, 300, 513], dtype=torch.int32)
    q = torch.randn(3, HEADS_Q, DIM, generator=g).to(torch.bfloat16)
    kw = dict(return_lse=True, k_scale=scales.k_scale, v_scale=scales.v_scale)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=2, **kw)
    want_out, want_lse = decode_attention_ref(q.float(), k_cache, v_cache, tables, lens, 0.125, **kw)
    torch.testing.assert_close(out, want_out, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
def test_interpreted_half_query_decode_keeps_small_terms_of_mixed_scales(dtype):
    """Value scales a million apart within one tile: the tokens with the highest probabilities
    have values a million times smaller than the rest, whose probabilities are about 2^-20 of
    theirs, so both halves of the output weigh the same. Each row's weights enter the float16 dot
    relative to the row's largest ``p * v_scale``; relative to the largest value scale the
    high-probability tokens' weights would be float16 subnormals, 2.9% off."""
    tokens, g = NUM_BLOCKS * BLOCK, torch.Generator().manual_seed(7)
    high = torch.arange(tokens) % 4 == 0
    k_cache = torch.ones(NUM_BLOCKS, BLOCK, HEADS_KV, DIM).to(dtype)
    v_cache = (torch.randn(NUM_BLOCKS, BLOCK, HEADS_KV, DIM, generator=g) * 100).to(dtype)
    k_scale = torch.where(high, 20.0, 20.0 - 20 * math.log(2) / 0.8).view(NUM_BLOCKS, BLOCK, 1).expand(-1, -1, HEADS_KV)
    v_scale = torch.where(high, 1e-6, 1.0).view(NUM_BLOCKS, BLOCK, 1).expand(-1, -1, HEADS_KV)
    k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    q = torch.full((1, HEADS_Q, DIM), 0.1).to(torch.bfloat16)  # every score 0.8 * k_scale
    tables = torch.arange(NUM_BLOCKS, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([tokens], dtype=torch.int32)
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True, **kw)[0]
    want = decode_attention_ref(q.float(), k_cache, v_cache, tables, lens, 0.125, True, **kw)[0]
    high_values = (v_cache.float() * high.view(NUM_BLOCKS, BLOCK, 1, 1)).to(dtype)
    small = decode_attention_ref(q.float(), k_cache, high_values, tables, lens, 0.125, True, **kw)[0]
    assert small.abs().mean() > 0.3 * want.abs().mean(), "the high-probability, small-value half weighs in"
    torch.testing.assert_close(out, want, atol=3e-3 * want.abs().max().item(), rtol=3e-3)


@interpreted_only
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype, value_size, query_size, num_blocks",
                         [(*case, 4) for case in HALF_CASES] + [(torch.bfloat16, 1.0, 1.0, 64), (torch.bfloat16, 1e-6, 1.0, 64)],
                         ids=[*HALF_IDS, "bfloat16-split", "bfloat16-tiny-values-split"])
def test_interpreted_half_query_ring_fold_matches_reference(dtype, q_dtype, value_size, query_size, num_blocks):
    """The ring fold with a 16-bit query; 1,024 keys: in parts merged by a second launch."""
    q, k_cache, v_cache, k_scale, v_scale, k_plain, v_plain = _half_case(dtype, q_dtype, value_size, query_size,
                                                                         (HEADS_Q, DIM), max(num_blocks, NUM_BLOCKS))
    k, v, kp, vp = (c[:num_blocks].flatten(0, 1) for c in (k_cache, v_cache, k_plain, v_plain))
    ks, vs = (sc[:num_blocks].flatten(0, 1) for sc in (k_scale, v_scale))
    start = (torch.randn(HEADS_Q, DIM) * value_size, torch.randn(HEADS_Q))
    state, want = [(start[0].clone(), start[1].clone()) for _ in range(2)]
    decode_attend_merge(q, k, v, *state, 0.125, ks, vs)
    decode_attend_merge_ref(q.float(), kp, vp, *want, 0.125)
    torch.testing.assert_close(state[0] / value_size, want[0] / value_size, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(state[1], want[1], atol=1e-4, rtol=1e-5)


@interpreted_only
def test_interpreted_page_gather_moves_scales():
    k_src, v_src, scales, _ = _stored_cache(torch.float8_e4m3fn)
    src, heads, to = torch.tensor([4, -1, 6, 1]), torch.tensor([1, 0, 0, 0]), torch.tensor([0, 1, 2, 0])
    got = []
    for gather in (gather_host_pages, gather_host_pages_ref):
        dst = [torch.zeros(3, BLOCK, HEADS_KV, DIM, dtype=torch.float8_e4m3fn) for _ in range(2)]
        dst_scales = (torch.zeros(3, BLOCK, HEADS_KV), torch.zeros(3, BLOCK, HEADS_KV))
        if gather is gather_host_pages:
            gather(k_src, v_src, src, heads, *dst, to, scales[:2], dst_scales)
        else:  # the reference of the pages, and of the scales as pages of head_dim 1
            gather(k_src, v_src, src, heads, *dst, to)
            gather(*(s.unsqueeze(-1) for s in scales[:2]), src, heads, *(s.unsqueeze(-1) for s in dst_scales), to)
        got.append((*(_bits(d) for d in dst), *dst_scales))
    for ours, ref in zip(*got):
        assert torch.equal(ours, ref)
    assert got[0][2].any()


# ---- the option, the spec, sizing ----------------------------------------------------------

@pytest.mark.parametrize("value", ["fp4", "FP8", "float8", 8, None, torch.float8_e4m3fn])
def test_bad_kv_cache_dtype_is_refused_and_the_engine_keeps_serving(qwen3_dir, value):
    with build_llm(qwen3_dir) as llm:
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', "
                                             rf"got {value!r:.10}"):
            build_llm(qwen3_dir, kv_cache_dtype=value)
        assert len(llm.generate([random_prompt(20, seed=5)], greedy(4), use_tqdm=False)[0]["token_ids"]) == 4


@pytest.mark.parametrize("name, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2), ("auto", torch.float32)])
def test_the_spec_carries_the_storage_dtype_and_scale_layout(qwen3_dir, caplog, name, dtype):
    with caplog.at_level(logging.INFO, logger="nanovllm.kvcache.cache"):
        with build_llm(qwen3_dir, kv_cache_dtype=name) as llm:
            cache = llm.model_runner.cache
            stats = llm.get_kv_cache_stats()
            out = llm.generate([random_prompt(300, seed=6)], greedy(4), use_tqdm=False)[0]["token_ids"]
            assert cache.kv.dtype == dtype and (cache.kv_scales is None) == (name == "auto")
    assert {(s.dtype, s.cache_dtype, s.scale_layout) for s in cache.specs} == {
        (torch.float32, dtype, "token_head" if name != "auto" else "none")}
    assert cache.geometry.layer_block_bytes == cache.specs[0].token_bytes * cache.geometry.block_size
    assert stats["kv_cache_dtype"] == name and stats["saturated_values"] == 0
    assert stats["gpu_tokens"] == stats["gpu_blocks"] * 256 and stats["host_tokens"] == 0
    assert len(out) == 4
    assert f"kv_cache_dtype='{name}'" in caplog.text and "tier 32 blocks = 8192 tokens" in caplog.text


@pytest.mark.parametrize("head_dim, ratio", [(64, 128 / 68), (128, 256 / 132)])
def test_fp8_holds_about_twice_the_tokens_in_both_tiers(qwen3_dir, monkeypatch, head_dim, ratio):
    """Bytes per token (scales included): bf16 ``2 * Hkv * 2D``, fp8 ``2 * Hkv * (D + 4)``, so the same
    memory holds 1.88x the tokens at head_dim 64 and 1.94x at 128."""
    specs = {dt: LayerKVSpec(8, head_dim, torch.bfloat16, cache_dtype=dt) for dt in (None, torch.float8_e4m3fn)}
    assert specs[None].token_bytes / specs[torch.float8_e4m3fn].token_bytes == pytest.approx(ratio)
    assert specs[torch.float8_e4m3fn].token_bytes == 2 * 8 * (head_dim + 4)
    monkeypatch.setattr(sizing, "host_memory_share", lambda fraction, ranks: 64 << 20)
    blocks = {}
    for name in ("auto", "fp8"):
        with build_llm(qwen3_dir, kv_cache_dtype=name, max_num_seqs=512, dtype="bfloat16") as llm:
            config, g = copy.copy(llm.config), llm.model_runner.cache.geometry
            config.num_kvcache_blocks = -1  # sized from the (patched) memory share, as without the option
            blocks[name] = (sizing.gpu_blocks(config, g, torch.device("cpu"), 0, 0, 1),
                            sizing.host_blocks(config, g, 1))
    assert blocks["auto"][0] < sizing.wanted_blocks(config), "the memory share, not the configuration, binds"
    head_ratio = (2 * 32) / (32 + 4)  # the checkpoint's head_dim is 32
    for tier in range(2):
        assert blocks["fp8"][tier] / blocks["auto"][tier] == pytest.approx(head_ratio, rel=0.01)


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)])
def test_fp8_e4m3_is_refused_below_compute_capability_8_9(qwen3_dir, monkeypatch, capability):
    """Triton has no float8_e4m3fn below sm_89: the config refuses it there, naming the option,
    the value, the device's capability and the limit; e5m2 and "auto" pass (a CUDA host of two
    devices, the second one's capability queried, faked on CPU)."""
    from nanovllm.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0) if i == 0 else capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"GPU{i}")
    for name in ("fp8", "fp8_e4m3"):
        if capability >= (8, 9):
            assert Config(qwen3_dir, device="cuda", kv_cache_dtype=name, data_parallel_size=2).kv_storage_dtype \
                == torch.float8_e4m3fn
            continue
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}' stores torch.float8_e4m3fn, which the Triton "
                                             rf"kernels need compute capability >= 8.9 for; cuda:1 \(GPU1\) has "
                                             rf"{capability[0]}.{capability[1]}: use kv_cache_dtype='fp8_e5m2'"):
            Config(qwen3_dir, device="cuda", kv_cache_dtype=name, data_parallel_size=2)
        Config(qwen3_dir, device="cuda", kv_cache_dtype=name)  # device 0 only
    for name in ("fp8_e5m2", "auto"):
        Config(qwen3_dir, device="cuda", kv_cache_dtype=name, data_parallel_size=2)


def test_data_parallel_stats_sum_the_counts_and_keep_the_dtype():
    from nanovllm.parallel.data_parallel import sum_kv_cache_stats

    replica = {"kv_cache_dtype": "fp8", "gpu_tokens": 512, "saturated_values": 3}
    assert sum_kv_cache_stats([replica, dict(replica, saturated_values=1)]) == {
        "kv_cache_dtype": "fp8", "gpu_tokens": 1024, "saturated_values": 4}


# ---- a checkpoint's static scales -----------------------------------------------------------

def _with_kv_scales(src: str, dst: Path, k_scale: float, v_scale: float) -> str:
    shutil.copytree(src, dst)
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for i in range(layers):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
        save_file(tensors, file)
    return str(dst)


def test_checkpoint_kv_scales_are_static_scales_and_saturate(qwen3_dir, tmp_path):
    prompt = [random_prompt(300, seed=7)]
    tiny = _with_kv_scales(qwen3_dir, tmp_path / "tiny", 1e-4, 1e-4)
    with build_llm(tiny, kv_cache_dtype="fp8") as llm:
        assert all(s.static_scales == pytest.approx((1e-4, 1e-4)) for s in llm.model_runner.cache.specs)
        llm.generate(prompt, greedy(4), use_tqdm=False)
        assert llm.get_kv_cache_stats()["saturated_values"] > 0, "keys beyond 448 x 1e-4 clamp"
        scales = llm.model_runner.cache.kv_scales
        written = scales == torch.tensor(1e-4)
        assert written.sum() >= 300 * scales[0, :, 0].numel() // 256 * 2, "every stored (token, head): the static scale"
        assert (written | (scales == 1.0)).all(), "the rest untouched since allocation"
    with build_llm(tiny) as llm, build_llm(qwen3_dir) as plain:
        assert {s.static_scales for s in llm.model_runner.cache.specs} == {None}, "ignored without fp8"
        assert token_ids(llm.generate(prompt, greedy(8), use_tqdm=False)) == \
            token_ids(plain.generate(prompt, greedy(8), use_tqdm=False))


# ---- key offsets ----------------------------------------------------------------------------

def test_a_constant_key_shift_leaves_attention_unchanged_and_cuts_the_fp8_error():
    """What the key offsets rest on (``nanovllm.kvcache.key_offset``): keys shifted by one vector
    per KV head give the same decode output in float32 (the LSE moves by the scaled ``q . mu``);
    and with large, nearly constant channels (a Qwen2-family key bias) the keys' fp8 error in the
    output is 4x smaller stored shifted than stored as they are."""
    g = torch.Generator().manual_seed(3)
    n = NUM_BLOCKS * BLOCK
    keys = torch.randn(n, HEADS_KV, DIM, generator=g)
    keys[:, :, 3] += 100.0  # two nearly constant outlier channels (a RoPE pair of a key bias):
    keys[:, :, 35] -= 70.0  # the row's largest is exact in fp8, the other is not
    values = torch.randn(n, HEADS_KV, DIM, generator=g)
    mu = keys.mean(0)
    q = torch.randn(3, HEADS_Q, DIM, generator=g)
    tables, lens, _ = _decode_cases(False, False)
    as_cache = lambda t: t.view(NUM_BLOCKS, BLOCK, HEADS_KV, DIM)  # noqa: E731
    out, lse = decode_attention_ref(q, as_cache(keys), as_cache(values), tables, lens, 0.125, True)
    shifted, shifted_lse = decode_attention_ref(q, as_cache(keys - mu), as_cache(values), tables, lens, 0.125, True)
    torch.testing.assert_close(shifted, out, atol=1e-5, rtol=1e-5)
    q_dot_mu = (q * mu.repeat_interleave(HEADS_Q // HEADS_KV, 0)).sum(-1) * 0.125
    torch.testing.assert_close(lse - shifted_lse, q_dot_mu, atol=1e-4, rtol=1e-4)
    errors = []
    for k in (keys, keys - mu):
        k_cache, v_cache = (torch.empty(NUM_BLOCKS, BLOCK, HEADS_KV, DIM, dtype=torch.float8_e4m3fn) for _ in range(2))
        scales = KVScales(*(torch.empty(NUM_BLOCKS, BLOCK, HEADS_KV) for _ in range(2)))
        store_kvcache(k, values, k_cache, v_cache, torch.arange(n), scales)
        got = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, k_scale=scales.k_scale,
                                   v_scale=scales.v_scale)
        v_plain = dequantize(v_cache, scales.v_scale, torch.float32)  # the keys' error alone
        want = decode_attention_ref(q, as_cache(keys), v_plain, tables, lens, 0.125)
        errors.append((got - want).abs().max().item())
    assert errors[1] < errors[0] / 4, errors


def test_the_benchmarks_own_attention_with_quantized_probabilities_follows_hfs(qwen3_dir):
    """key_offset_sources' ``probs`` case computes causal GQA attention itself (the probabilities
    quantized to e4m3): its logits move, but stay those of HF's attention up to that rounding."""
    import torch.nn.functional as F

    ids = list(range(4, 100))
    exact = hf_logits(str(qwen3_dir), ids)
    ours = quantized_logits(str(qwen3_dir), ids, None, keys=False, values=False, probs=True)
    assert not torch.equal(ours, exact), "the probabilities were quantized"
    kl = (F.softmax(exact, -1) * (F.log_softmax(exact, -1) - F.log_softmax(ours, -1))).sum(-1)
    assert kl.max() < 1e-3, kl.max()


def test_an_fp8_cache_stores_keys_minus_their_mean_over_the_calibration_prefill(qwen3_dir):
    """The offsets are HF transformers' mean key after RoPE over the calibration tokens, per
    (layer, KV head, channel), the same in every build; a cache that is not fp8 has none and
    refuses them; offsets of another shape, or offsets once the cache is allocated, are refused;
    the calibration leaves nothing in the sparse statistics."""
    from nanovllm.kvcache.key_offset import calibration_token_ids

    builds = []
    for _ in range(2):
        with build_llm(qwen3_dir, dtype="float32", kv_cache_dtype="fp8") as llm:
            cache = llm.model_runner.cache
            builds.append(cache.attention.key_offsets.clone())
            config = llm.model_runner.config
            with pytest.raises(ValueError, match=r"float32 \(\d+, \d+, \d+\)"):
                cache.set_key_offsets(builds[-1][:, :1])
            with pytest.raises(RuntimeError, match="before the cache is allocated"):
                cache.set_key_offsets(builds[-1].float())
    assert torch.equal(builds[0], builds[1])
    calibration = calibration_token_ids(config.hf_config.vocab_size, config.max_model_len)
    want = hf_key_means(str(qwen3_dir), calibration.tolist())
    torch.testing.assert_close(builds[0], want, atol=1e-4, rtol=1e-4)
    assert builds[0].abs().max() > 0
    with build_llm(qwen3_dir) as llm:
        assert llm.model_runner.cache.attention.key_offsets is None
        with pytest.raises(ValueError, match="fp8 cache"):
            llm.model_runner.cache.set_key_offsets(builds[0])
    stats = {}
    for kv in ("fp8", "auto"):  # XAttention's prefill counts blocks: the calibration's are not kept
        with build_llm(qwen3_dir, kv_cache_dtype=kv, sparse_policy="XATTN_BSA", max_num_batched_tokens=256) as llm:
            stats[kv] = llm.get_sparse_stats()
    assert stats["fp8"] == stats["auto"]


# ---- chunking and prefix hits ---------------------------------------------------------------

def _max_difference(got, ref) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got[1], ref[1]))


def test_chunked_prefill_and_prefix_hits_see_the_stored_values(qwen3_dir):
    """A chunk attends to its own tokens as stored, so a prefix-cache hit and chunks of 100 give
    one chunk's tokens, and logits that differ only where float32 sums in another order (other
    chunk boundaries) round a later layer's key to the neighbouring fp8 value now and then
    (measured up to 2e-4)."""
    prompts = [random_prompt(700, seed=8), random_prompt(300, seed=9)]
    runs = {}
    for chunk in (16384, 100):
        with build_llm(qwen3_dir, kv_cache_dtype="fp8", max_num_batched_tokens=chunk) as llm:
            runs[chunk] = generate_with_logits(llm, prompts, 8)
            hit = generate_with_logits(llm, prompts, 8)
            assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] >= 512 + 256
        assert hit[0] == runs[chunk][0] and _max_difference(hit, runs[chunk]) <= 1e-3
    assert runs[100][0] == runs[16384][0]
    assert _max_difference(runs[100], runs[16384]) <= 1e-3


def test_xattn_estimates_over_the_dequantized_gpu_tier_prefix(qwen3_dir):
    """XATTN_BSA at threshold 1.0 keeps every block, so in chunks of 256 on the GPU tier (its
    estimate and attention over the fp8 prefix gathered from the cache) it gives FULL's tokens; a
    100-token prompt, too short for an estimate, takes the dense path over the fp8 cache."""
    prompts = [random_prompt(n, seed=600 + n) for n in (100, 700, 1000)]
    runs = {}
    for policy in ("FULL", "XATTN_BSA"):
        extra = dict(sparse_threshold=1.0) if policy == "XATTN_BSA" else {}
        with build_llm(qwen3_dir, kv_cache_dtype="fp8", max_num_batched_tokens=256, sparse_policy=policy,
                       **extra) as llm:
            runs[policy] = generate_with_logits(llm, prompts, 8)
    assert runs["XATTN_BSA"][0] == runs["FULL"][0]
    assert _max_difference(runs["XATTN_BSA"], runs["FULL"]) <= 1e-3


def test_sliding_window_fp8_over_both_tiers_and_in_chunks_gives_gpu_only_tokens(mistral_dir):
    """Mistral's window (300 tokens, its edge inside a block) with fp8 KV: the host tier holding most
    window blocks, and chunks of 128, give the GPU-only fp8 engine's tokens (logits to 1e-3, as in
    test_tiers.py)."""
    prompts = [random_prompt(n, seed=500 + n) for n in (100, 700, 900)]
    runs = {}
    for name, opts in (("gpu", dict(num_kvcache_blocks=16)), ("chunks", dict(num_kvcache_blocks=16,
                                                                              max_num_batched_tokens=128)),
                       ("host", dict(num_kvcache_blocks=2, enable_cpu_offload=True, num_cpu_kvcache_blocks=16,
                                     num_ring_slots=2))):
        with build_llm(mistral_dir, max_model_len=1024, kv_cache_dtype="fp8", **opts) as llm:
            runs[name] = generate_with_logits(llm, prompts, 32)
            if name == "host":
                assert llm.get_kv_cache_stats()["spilled_blocks"] > 0
    for name in ("chunks", "host"):
        assert runs[name][0] == runs["gpu"][0], name
        assert _max_difference(runs[name], runs["gpu"]) <= 1e-3, name


# ---- SmolLM2: fp8 e4m3 KV against float32 KV ------------------------------------------------

SMOLLM2_MIN_AGREEMENT = 0.95
"""Teacher-forced top-1 agreement of e4m3 KV with float32 KV that SmolLM2-135M reaches on README.md
(measured 0.962, 615 of 639, keys stored minus their offsets; docs/kvcache.md, "FP8 KV"): below the
issue's 0.98, which the format itself does not reach on this model: an independent fake
quantization of keys (minus the same offsets) and values in HF transformers gives 0.962 too
(bf16 KV: 0.991)."""


def _hf_top1(model: str, ids: list[int], quantize: bool, max_model_len: int) -> list[int]:
    """HF transformers' teacher-forced top-1 of SmolLM2 in float32, when ``quantize`` its keys
    (after RoPE, minus their mean over the engine's calibration tokens for ``max_model_len``) and
    values quantized per (token, KV head) by :func:`quantize_ref` and dequantized."""
    from transformers import AutoConfig

    from nanovllm.kvcache.key_offset import calibration_token_ids

    if quantize:
        calibration = calibration_token_ids(AutoConfig.from_pretrained(model).vocab_size, max_model_len)
        logits = quantized_logits(model, ids, hf_key_means(model, calibration.tolist()))
    else:
        logits = hf_logits(model, ids)
    return logits[:-1].argmax(-1).tolist()


@pytest.mark.slow
def test_smollm2_fp8_kv_agrees_with_float32_kv_on_real_text():
    """README.md's first 640 tokens, prefilled in chunks of 128 (later chunks read earlier ones from
    the cache): top-1 of e4m3 KV against float32 KV, at least :data:`SMOLLM2_MIN_AGREEMENT` and within
    2 points of HF transformers with the same key offsets and quantization applied to its keys and values (the
    engine's stores, tiers and kernels lose nothing beyond the format)."""
    from transformers import AutoTokenizer

    from nanovllm import LLM
    from nanovllm.fetch import fetch_model

    model = fetch_model()
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"][:640]
    assert len(ids) == 640
    top1 = {}
    for kv in ("auto", "fp8_e4m3"):
        with LLM(model, dtype="float32", device="cpu", max_model_len=1024, enforce_eager=True,
                 max_num_batched_tokens=128, kv_cache_dtype=kv) as llm:
            top1[kv] = teacher_forced(llm, ids)[0]
    assert len(top1["auto"]) == 639 >= 512
    agreement = sum(a == b for a, b in zip(top1["auto"], top1["fp8_e4m3"])) / len(top1["auto"])
    hf = [_hf_top1(model, ids, quantize, 1024) for quantize in (False, True)]
    hf_agreement = sum(a == b for a, b in zip(*hf)) / len(hf[0])
    assert agreement >= SMOLLM2_MIN_AGREEMENT, (agreement, hf_agreement)
    assert abs(agreement - hf_agreement) <= 0.02, (agreement, hf_agreement)
