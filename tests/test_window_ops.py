"""Sliding-window kernels on CPU: references against float64 math, the CPU paths and the Triton
kernels (under Triton's interpreter, in a child pytest, as tests/test_ops.py runs them) against the
references. A query at position p sees the keys p - W + 1 .. p (transformers' sliding window)."""

import math

import pytest
import torch

from _interpreter import interpreted_only, run_interpreted_tests

from nanovllm.ops import (block_sparse_attention, block_sparse_attention_ref, decode_attend_merge,
                          decode_attend_merge_ref, decode_attention, decode_attention_ref, prefill_attention,
                          prefill_attention_ref)
from nanovllm.ops.block_lists import kept_block_lists, kept_block_lists_ref
from nanovllm.ops.window_attention import (sliding_window_attention, sliding_window_attention_ref,
                                           visible_block_layout, visible_blocks, window_start)


def naive_window(q, keys, values, scale, window):
    """q [Sq, Hq, D] (the last Sq of Sk positions), keys/values [Sk, Hkv, D] -> [Sq, Hq, D], float64 loops."""
    seq_q, heads_q, _ = q.shape
    seq_k, heads_kv = keys.shape[:2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(heads_q):
        kv = h // (heads_q // heads_kv)
        for i in range(seq_q):
            p = seq_k - seq_q + i
            lo = max(0, p - window + 1)
            s = (keys[lo:p + 1, kv].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ values[lo:p + 1, kv].double()
    return out


def paged(contexts, block_size, heads_kv, dim, dtype=torch.float32, seed=0):
    """Every context in shuffled blocks of one cache; tables int32 (-1 padded); the contexts' keys and values."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / block_size) for n in contexts]
    num_blocks = sum(counts) + 3
    k_cache = torch.randn(num_blocks, block_size, heads_kv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads_kv, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(contexts), max(counts) + 1), -1, dtype=torch.int32)
    used, keys, values = 0, [], []
    for b, (n, count) in enumerate(zip(contexts, counts)):
        tables[b, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
        pos = torch.arange(n)
        keys.append(k_cache[tables[b, pos // block_size].long(), pos % block_size])
        values.append(v_cache[tables[b, pos // block_size].long(), pos % block_size])
    return k_cache, v_cache, tables, keys, values


def window_rows(contexts, block_size, window):
    """The decode rows of a window as the step inputs build them: each table from the window's first
    block, its length from there and the start (tokens of that block before the window)."""
    firsts = [window_start(n - 1, window) if n else 0 for n in contexts]
    return [f // block_size for f in firsts], [n - f // block_size * block_size for n, f in zip(contexts, firsts)], \
        [f % block_size for f in firsts]


def windowed_decode_case(contexts, block_size, window, heads_q, heads_kv, dim, dtype=torch.float32):
    k_cache, v_cache, tables, keys, values = paged(contexts, block_size, heads_kv, dim, dtype)
    first_blocks, lens, starts = window_rows(contexts, block_size, window)
    width = tables.shape[1]
    cut = torch.full_like(tables, -1)
    for b, fb in enumerate(first_blocks):
        cut[b, :width - fb] = tables[b, fb:]
    # every slot before a row's window holds NaN: a read of it would show
    for b, (fb, n) in enumerate(zip(first_blocks, contexts)):
        for t in range(window_start(n - 1, window) if n else 0):
            k_cache[tables[b, t // block_size].long(), t % block_size] = float("nan")
    q = (torch.randn(len(contexts), heads_q, dim) * 2).to(dtype)
    return q, k_cache, v_cache, cut, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), \
        keys, values


# ---------------------------------------------------------------- references and CPU paths
@pytest.mark.parametrize("window", [1, 7, 64, 300, 5000])
def test_sliding_window_attention_matches_float64_math(window):
    gen = torch.Generator().manual_seed(window)
    q, k, v = torch.randn(333, 4, 16, generator=gen), torch.randn(500, 2, 16, generator=gen), \
        torch.randn(500, 2, 16, generator=gen)
    want = naive_window(q, k, v, 0.3, window)
    torch.testing.assert_close(sliding_window_attention_ref(q, k, v, 0.3, window).double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(sliding_window_attention(q, k, v, 0.3, window).double(), want, atol=1e-5, rtol=0)


def test_sliding_window_attention_checks_its_arguments():
    q, k = torch.randn(4, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="the 4 queries must be the last of the 3 keys"):
        sliding_window_attention(q, k, k, 1.0, 8)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
            sliding_window_attention(q, q[:, :2], q[:, :2], 1.0, bad)


def prefill_window_case(seqlens_q, prefixes, block_size=16, heads_q=4, heads_kv=2, dim=32, seed=0):
    contexts = [p + n for p, n in zip(prefixes, seqlens_q)]
    k_cache, v_cache, tables, keys, values = paged(contexts, block_size, heads_kv, dim, seed=seed)
    q = torch.randn(sum(seqlens_q), heads_q, dim)
    k = torch.cat([kk[p:] for kk, p in zip(keys, prefixes)])
    v = torch.cat([vv[p:] for vv, p in zip(values, prefixes)])
    return q, k, v, contexts, k_cache, v_cache, tables, keys, values


@pytest.mark.parametrize("window", [1, 10, 37, 300])
def test_prefill_in_a_window_matches_float64_math_with_cached_and_given_prefixes(window):
    """Chunks with and without a cached prefix, an empty chunk, a prefix given gathered (whole, or
    only its last rows): the window's keys only, from the cache's blocks or the given rows."""
    seqlens_q, prefixes = [20, 0, 33, 5, 40], [0, 12, 50, 100, 17]
    q, k, v, lens_k, k_cache, v_cache, tables, keys, values = prefill_window_case(seqlens_q, prefixes)
    start = 0
    for given in ({}, {3: (keys[3][:100], values[3][:100])},
                  {3: (keys[3][100 - max(window - 1, 1):100], values[3][100 - max(window - 1, 1):100])}):
        if window == 1 and given:
            given = {3: (keys[3][99:100], values[3][99:100])}
        for fn in (prefill_attention, prefill_attention_ref):
            out = fn(q, k, v, seqlens_q, lens_k, 0.25, k_cache, v_cache, tables, given, sliding_window=window)
            start = 0
            for i, n in enumerate(seqlens_q):
                want = naive_window(q[start:start + n], keys[i], values[i], 0.25, window)
                torch.testing.assert_close(out[start:start + n].double(), want, atol=1e-5, rtol=0)
                start += n


def test_prefill_window_reads_no_key_before_the_window():
    """NaN in every cached slot before the chunk's windows: nothing reads them."""
    window, seqlens_q, prefixes = 20, [30, 8], [64, 40]
    q, k, v, lens_k, k_cache, v_cache, tables, keys, values = prefill_window_case(seqlens_q, prefixes)
    for b, p in enumerate(prefixes):
        for t in range(window_start(p, window)):
            k_cache[tables[b, t // 16].long(), t % 16] = float("nan")
    out = prefill_attention(q, k, v, seqlens_q, lens_k, 0.25, k_cache, v_cache, tables, sliding_window=window)
    assert torch.isfinite(out).all()
    ref = prefill_attention_ref(q, k, v, seqlens_q, lens_k, 0.25, k_cache, v_cache, tables, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_prefill_window_rejects_a_given_prefix_too_short_for_it():
    q, k, v, lens_k, k_cache, v_cache, tables, keys, values = prefill_window_case([5], [40])
    with pytest.raises(ValueError, match=r"prefixes\[0\] must be two tensors of shape \(40, 2, 32\) \(or its last "
                                         r"9 or more rows\)"):
        prefill_attention(q, k, v, [5], lens_k, 0.25, prefixes={0: (keys[0][32:40], values[0][32:40])},
                          sliding_window=10)
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
        prefill_attention(q, k, v, [5], lens_k, 0.25, k_cache, v_cache, tables, sliding_window=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size,window", [(16, 20), (16, 16), (8, 1), (256, 300)])
def test_cpu_decode_with_starts_matches_the_reference(dtype, tol, block_size, window):
    """Tables cut to each window's blocks with the window's first token as the start; every slot
    before a window holds NaN (the CPU path gathers from the starts on); rows with nothing to read
    (padding) give 0 and lse -inf."""
    contexts = [1, window, window + 1, 3 * block_size + 5, 2 * block_size, 0, 700]
    q, k_cache, v_cache, tables, lens, starts, keys, values = windowed_decode_case(contexts, block_size, window, 4, 2,
                                                                                   32, dtype)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.2, return_lse=True, context_starts=starts)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2, return_lse=True,
                                        context_starts=starts)
    assert torch.isfinite(out).all() and (out[5] == 0).all() and torch.isneginf(lse[5]).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)
    live = lens > 0
    torch.testing.assert_close(lse[live], ref_lse[live], atol=1e-5, rtol=1e-5)
    for b, n in enumerate(contexts):
        if n:
            want = naive_window(q[b][None].float(), keys[b].float(), values[b].float(), 0.2, window)[0]
            torch.testing.assert_close(ref[b].double(), want, atol=max(tol, 1e-5), rtol=0)


def test_decode_starts_are_checked():
    q, k_cache, v_cache, tables, lens, starts, _, _ = windowed_decode_case([40, 9], 16, 20, 4, 2, 32)
    with pytest.raises(ValueError, match=r"context_starts must be int32 or int64 \[B=2\]"):
        decode_attention(q, k_cache, v_cache, tables, lens, 0.2, context_starts=starts[:1])
    bad = torch.tensor([4, 10], dtype=torch.int32)
    for fn in (decode_attention, decode_attention_ref):
        with pytest.raises(ValueError, match=r"context_starts\[1\]=10 is outside 0..context_lens\[1\]=9"):
            fn(q, k_cache, v_cache, tables, lens, 0.2, context_starts=bad)


def test_decode_without_starts_is_unchanged_by_zero_starts():
    """context_starts of zeros read what no starts read (the full-attention path)."""
    k_cache, v_cache, tables, _, _ = paged([0, 5, 40, 33], 16, 2, 32)
    q, lens = torch.randn(4, 4, 32), torch.tensor([0, 5, 40, 33], dtype=torch.int32)
    plain = decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    zeros = decode_attention(q, k_cache, v_cache, tables, lens, 0.2, context_starts=torch.zeros(4, dtype=torch.int32))
    assert torch.equal(plain, zeros)


def test_folding_a_host_block_from_its_window_start_equals_the_window():
    """A host block folded from its ``skip``-th token (the ring's first block in a window)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 32, generator=gen), torch.randn(256, 2, 32, generator=gen), \
        torch.randn(256, 2, 32, generator=gen)
    out, lse = torch.zeros(4, 32), torch.full((4,), float("-inf"))
    decode_attend_merge(q, k[100:], v[100:], out, lse, 0.2)
    want = naive_window(q[None], k, v, 0.2, 156)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_visible_block_layout_is_the_band_of_the_token_mask():
    for seq_q, seq_k, window, block in ((70, 300, 50, 16), (64, 64, 1, 16), (33, 200, 300, 32)):
        layout = visible_block_layout(-(-seq_q // block), -(-seq_k // block), block, seq_q, seq_k, window, "cpu")
        rows = torch.arange(seq_q) + seq_k - seq_q
        keys = torch.arange(seq_k)
        tokens = (keys[None] <= rows[:, None]) & (keys[None] > rows[:, None] - window)
        padded = torch.zeros(layout.shape[0] * block, layout.shape[1] * block, dtype=torch.bool)
        padded[:seq_q, :seq_k] = tokens
        want = padded.view(layout.shape[0], block, layout.shape[1], block).any(3).any(1)
        assert torch.equal(layout, want)
        assert visible_blocks(seq_q, seq_k, block, window) == int(want.sum())


def test_block_sparse_reference_with_a_window_is_windowed_attention():
    """Every block kept: windowed attention; a mask of some blocks: the window within them."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(100, 4, 16, generator=gen), torch.randn(260, 2, 16, generator=gen), \
        torch.randn(260, 2, 16, generator=gen)
    full = torch.ones(4, 7, 17, dtype=torch.bool)
    out, _ = block_sparse_attention(q, k, v, full, 16, 0.25, window=40)
    torch.testing.assert_close(out.double(), naive_window(q, k, v, 0.25, 40), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="window=0 must be None or an int >= 1 with causal=True"):
        block_sparse_attention(q, k, v, full, 16, 0.25, window=0)


# ---------------------------------------------------------------- Triton kernels (interpreter)
@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,window,num_splits", [(16, 20, None), (16, 40, 3), (8, 1, 2), (256, 300, 1),
                                                          (32, 100, 5)])
def test_interpreted_decode_with_starts_matches_reference(dtype, block_size, window, num_splits):
    """Split-K over tables cut to the windows; NaN before every window (never read by the kernel)."""
    contexts = [1, window, window + 1, 3 * block_size + 5, 0, 2 * block_size]
    q, k_cache, v_cache, tables, lens, starts, _, _ = windowed_decode_case(contexts, block_size, window, 6, 2, 64,
                                                                           dtype)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits, return_lse=True,
                                context_starts=starts)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True,
                                        context_starts=starts)
    assert torch.isfinite(out).all() and (out[4] == 0).all() and torch.isneginf(lse[4]).all()
    torch.testing.assert_close(out, ref.float(), atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=0)
    live = lens > 0
    torch.testing.assert_close(lse[live], ref_lse[live], atol=1e-5, rtol=1e-5)
    plain = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits, context_starts=starts)
    assert torch.equal(plain, out.to(dtype))


@interpreted_only
def test_interpreted_decode_attend_merge_from_a_skip():
    q, k, v = torch.randn(4, 32), torch.randn(256, 2, 32), torch.randn(256, 2, 32)
    states = []
    for fold in (decode_attend_merge, decode_attend_merge_ref):
        out, lse = torch.zeros(4, 32), torch.full((4,), float("-inf"))
        fold(q, k[77:], v[77:], out, lse, 0.2)
        states.append((out, lse))
    torch.testing.assert_close(states[0][0], states[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(states[0][1], states[1][1], atol=1e-5, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize("seq_q,seq_k,window", [(64, 64, 20), (100, 260, 40), (48, 300, 1), (80, 90, 500)])
def test_interpreted_kept_block_lists_with_a_window(seq_q, seq_k, window):
    gen = torch.Generator().manual_seed(seq_k)
    mask = torch.rand(3, -(-seq_q // 16), -(-seq_k // 16), generator=gen) < 0.7
    got = kept_block_lists(mask, 16, seq_q, seq_k, True, window)
    want = kept_block_lists_ref(mask, 16, seq_q, seq_k, True, window)
    for g_count, g_index, w_count, w_index in ((got[0], got[1], want[0], want[1]), (got[2], got[3], want[2], want[3])):
        assert torch.equal(g_count, w_count)
        for h in range(mask.shape[0]):
            for qb in range(mask.shape[1]):
                n = int(w_count[h, qb])
                assert torch.equal(g_index[h, qb, :n], w_index[h, qb, :n])


@interpreted_only
@pytest.mark.parametrize("window", [1, 20, 40, 130])
def test_interpreted_block_sparse_attention_with_a_window(window):
    """Blocks kept at random: dropped wholly before a window, masked per key across its edge."""
    gen = torch.Generator().manual_seed(window)
    q, k, v = torch.randn(100, 4, 16, generator=gen), torch.randn(260, 2, 16, generator=gen), \
        torch.randn(260, 2, 16, generator=gen)
    mask = torch.rand(4, 7, 17, generator=gen) < 0.6
    mask[:, torch.arange(7), torch.arange(7) + 10] = True  # each query block's diagonal block
    out, lse = block_sparse_attention(q, k, v, mask, 16, 0.25, window=window)
    ref, ref_lse = block_sparse_attention_ref(q, k, v, mask, 16, 0.25, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse))
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-5)


def test_window_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=19)
