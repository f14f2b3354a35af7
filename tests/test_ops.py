"""CPU tests of nanovllm.ops: references against plain float64 math, public functions against
references, and the Triton kernels run on CPU tensors through Triton's interpreter.

The interpreter must be switched on before Triton is imported, so the ``test_interpreted_*``
tests run in a child pytest started by ``test_triton_kernels_under_interpreter`` with
TRITON_INTERPRET=1 and NANOVLLM_TRITON_INTERPRET=1; in the parent run they are skipped.
"""

import importlib
import math

import pytest
import torch

from _interpreter import eager_only, interpreted_only, run_interpreted_tests

from nanovllm.ops import decode_merge
from nanovllm.ops import (
    KVStore,
    apply_rotary,
    apply_rotary_ref,
    decode_attend_merge,
    decode_attend_merge_ref,
    decode_attention,
    decode_attention_ref,
    flash_attn_with_lse,
    flash_attn_with_lse_ref,
    gather_host_pages,
    gather_host_pages_ref,
    gather_kvcache,
    merge_attention_outputs,
    merge_attention_outputs_ref,
    prefill_attention,
    prefill_attention_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_ref,
    store_kvcache,
    store_kvcache_ref,
)

NEG_INF = float("-inf")


# ---------------------------------------------------------------- plain float64 math
def naive_attention(q, keys, values, scale, causal):
    """q [Sq, Hq, D], keys/values [Sk, Hkv, D] -> (out [Sq, Hq, D], lse [Hq, Sq]), float64 loops."""
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = keys.shape[0], keys.shape[1]
    out = torch.zeros(seq_q, heads_q, dim, dtype=torch.float64)
    lse = torch.full((heads_q, seq_q), NEG_INF, dtype=torch.float64)
    for h in range(heads_q):
        kv = h // (heads_q // heads_kv)
        for i in range(seq_q):
            visible = seq_k - seq_q + i + 1 if causal else seq_k
            if visible <= 0:
                continue
            scores = keys[:visible, kv].double() @ q[i, h].double() * scale
            top = scores.max()
            weights = torch.exp(scores - top)
            lse[h, i] = top + torch.log(weights.sum())
            out[i, h] = weights @ values[:visible, kv].double() / weights.sum()
    return out, lse


def make_paged_cache(contexts, block_size, heads_kv, dim, dtype, spare_blocks=3, pad_table=2):
    """Random caches holding each context in shuffled blocks; returns caches, tables (int32,
    padded with -1) and the contiguous per-sequence keys/values."""
    blocks_per_seq = [math.ceil(n / block_size) for n in contexts]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, heads_kv, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads_kv, dim).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq, default=0) + pad_table
    tables = torch.full((len(contexts), width), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    keys = [k_cache[tables[b, :c].long()].flatten(0, 1)[:n] for b, (c, n) in enumerate(zip(blocks_per_seq, contexts))]
    values = [v_cache[tables[b, :c].long()].flatten(0, 1)[:n] for b, (c, n) in enumerate(zip(blocks_per_seq, contexts))]
    return k_cache, v_cache, tables, keys, values


def assert_close(actual, expected, tol):
    assert actual.shape == expected.shape
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- references vs float64 math
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(5, 5), (3, 9), (1, 7), (6, 4), (4, 0)])
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (6, 2), (8, 2)])
def test_flash_attn_with_lse_ref_matches_math(causal, seq_q, seq_k, heads_q, heads_kv):
    batch, dim, scale = 2, 16, 0.3
    q = torch.randn(batch, seq_q, heads_q, dim, dtype=torch.float64)
    k = torch.randn(batch, seq_k, heads_kv, dim, dtype=torch.float64)
    v = torch.randn(batch, seq_k, heads_kv, dim, dtype=torch.float64)
    out, lse = flash_attn_with_lse_ref(q, k, v, scale, causal)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert lse.shape == (batch, heads_q, seq_q)
    for b in range(batch):
        ref_out, ref_lse = naive_attention(q[b], k[b], v[b], scale, causal)
        assert_close(out[b], ref_out, 1e-10)
        torch.testing.assert_close(lse[b].double(), ref_lse, atol=1e-5, rtol=1e-6)
    if causal and seq_q > seq_k:
        assert torch.isneginf(lse[:, :, : seq_q - seq_k]).all()
        assert (out[:, : seq_q - seq_k] == 0).all()


def test_flash_attn_with_lse_ref_low_precision_returns_input_dtype():
    q = torch.randn(1, 7, 4, 32)
    k, v = torch.randn(1, 7, 2, 32), torch.randn(1, 7, 2, 32)
    out, lse = flash_attn_with_lse_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32**-0.5, True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, _ = naive_attention(q[0].bfloat16(), k[0].bfloat16(), v[0].bfloat16(), 32**-0.5, True)
    assert_close(out[0], ref, 1e-2)


@pytest.mark.parametrize("split", [0, 3, 8, 11])
def test_merge_ref_equals_attention_over_union(split):
    q = torch.randn(2, 4, 6, 16, dtype=torch.float64)
    k, v = torch.randn(2, 11, 3, 16, dtype=torch.float64), torch.randn(2, 11, 3, 16, dtype=torch.float64)
    o1, lse1 = flash_attn_with_lse_ref(q, k[:, :split], v[:, :split], 0.25, False)
    o2, lse2 = flash_attn_with_lse_ref(q, k[:, split:], v[:, split:], 0.25, False)
    out, lse = merge_attention_outputs_ref(o1, lse1, o2, lse2)
    full_out, full_lse = flash_attn_with_lse_ref(q, k, v, 0.25, False)
    assert_close(out, full_out, 1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-6)


def neg_inf_merge_inputs(dtype):
    """Inputs whose lse are -inf on one side (that side's o holds NaN garbage) or on both."""
    o1, o2 = torch.randn(2, 5, 3, 16).to(dtype), torch.randn(2, 5, 3, 16).to(dtype)
    lse1, lse2 = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    lse1[0, 0, :] = NEG_INF
    o1[0, :, 0] = float("nan")
    lse2[1, 2, 1:3] = NEG_INF
    o2[1, 1:3, 2] = float("nan")
    lse1[0, 1, 4] = lse2[0, 1, 4] = NEG_INF
    o1[0, 4, 1] = float("nan")
    return o1, lse1, o2, lse2


def check_neg_inf_merge(out, lse, o1, lse1, o2, lse2):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, :4, 0], o2[0, :4, 0]) and torch.equal(lse[0, 0, :4], lse2[0, 0, :4])
    assert torch.equal(out[1, 1:3, 2], o1[1, 1:3, 2]) and torch.equal(lse[1, 2, 1:3], lse1[1, 2, 1:3])
    assert (out[0, 4, 1] == 0).all() and torch.isneginf(lse[0, 1, 4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_ref_neg_inf_is_exact_and_nan_free(dtype):
    o1, lse1, o2, lse2 = neg_inf_merge_inputs(dtype)
    out, lse = merge_attention_outputs_ref(o1, lse1, o2, lse2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    check_neg_inf_merge(out, lse, o1, lse1, o2, lse2)


def check_nan_merge(merge):
    """A NaN lse, or NaN in a non-empty side's o, propagates to o (and, for the lse, to lse)."""
    o1, o2 = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    lse1, lse2 = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    lse1[0, 0, 1] = float("nan")
    o2[0, 2, 1, 3] = float("nan")
    out, lse = merge(o1, lse1, o2, lse2)
    assert torch.isnan(out[0, 1, 0]).all() and torch.isnan(lse[0, 0, 1])
    assert torch.isnan(out[0, 2, 1, 3]) and not torch.isnan(lse[0, 1, 2])
    assert not torch.isnan(out[0, 0]).any() and not torch.isnan(out[0, 3]).any()


def test_merge_ref_propagates_nan():
    check_nan_merge(merge_attention_outputs_ref)


def prefill_case(dtype, seqlens_q, prefixes, block_size=4, heads_q=6, heads_kv=2, dim=16):
    """Packed q/k/v plus a paged cache holding [prefix, new] of every sequence."""
    seqlens_k = [n + p for n, p in zip(seqlens_q, prefixes)]
    k_cache, v_cache, tables, keys, values = make_paged_cache(seqlens_k, block_size, heads_kv, dim, dtype)
    q = torch.randn(sum(seqlens_q), heads_q, dim).to(dtype)
    k = torch.cat([keys[i][p:] for i, p in enumerate(prefixes)])
    v = torch.cat([values[i][p:] for i, p in enumerate(prefixes)])
    return q, k, v, seqlens_k, k_cache, v_cache, tables, keys, values


def test_prefill_ref_matches_math_with_prefix_and_gqa():
    seqlens_q, prefixes = [3, 0, 4, 1, 6], [5, 2, 0, 9, 3]
    q, k, v, seqlens_k, k_cache, v_cache, tables, keys, values = prefill_case(torch.float64, seqlens_q, prefixes)
    out = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 0.3, k_cache, v_cache, tables)
    start = 0
    for i, n in enumerate(seqlens_q):
        expected, _ = naive_attention(q[start : start + n], keys[i], values[i], 0.3, True)
        assert_close(out[start : start + n], expected, 1e-10)
        start += n


def test_prefill_ref_without_cache():
    q, k, v = (torch.randn(9, 4, 8, dtype=torch.float64) for _ in range(3))
    out = prefill_attention_ref(q, k, v, [4, 5], [4, 5], 0.5)
    assert_close(out[:4], naive_attention(q[:4], k[:4], v[:4], 0.5, True)[0], 1e-10)
    assert_close(out[4:], naive_attention(q[4:], k[4:], v[4:], 0.5, True)[0], 1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["cache", "reader"])
def test_prefill_attends_a_long_prefix_one_segment_at_a_time(source, dtype, tol, monkeypatch):
    """A prefix longer than a segment is gathered (from the cache, or by its reader) and attended
    one block-aligned segment at a time, in order, each token once, merged by LSE: the result is
    the one-pass reference's; the transient rows never exceed a segment."""
    pa = importlib.import_module("nanovllm.ops.prefill_attention")  # the package re-exports its function

    seqlens_q, prefixes = [3, 5, 4], [37, 0, 13]
    q, k, v, seqlens_k, k_cache, v_cache, tables, keys, values = prefill_case(dtype, seqlens_q, prefixes)
    monkeypatch.setattr(pa, "PREFIX_SEGMENT_BYTES", 9 * k.shape[1] * k.shape[2] * k.element_size())
    assert pa.segment_tokens(k, 4) == 8 and pa.segment_tokens(k, None) == 9, "9 rows: two blocks of 4"
    asked, given = [], {}
    if source == "reader":
        for i in (0, 2):
            given[i] = lambda first, last, i=i: asked.append((i, first, last)) or (keys[i][first:last],
                                                                                 values[i][first:last])
    else:
        gather = pa.gather_tokens
        monkeypatch.setattr(pa, "gather_tokens", lambda cache, table, first, last, *args: (
            asked.append((int(tables.tolist().index(table.tolist())), first, last)) if cache is k_cache else None)
            or gather(cache, table, first, last, *args))
    out = prefill_attention(q, k, v, seqlens_q, seqlens_k, 0.3, k_cache, v_cache, tables, given)
    assert asked == [(0, 0, 8), (0, 8, 16), (0, 16, 24), (0, 24, 32), (0, 32, 37), (2, 0, 8), (2, 8, 13)]
    ref = prefill_attention_ref(q.double(), k.double(), v.double(), seqlens_q, seqlens_k, 0.3, k_cache.double(),
                                v_cache.double(), tables)
    assert out.dtype == dtype
    assert_close(out, ref, tol)


def test_prefill_refuses_a_reader_that_returns_other_rows():
    seqlens_q, prefixes = [3], [10]
    q, k, v, seqlens_k, k_cache, v_cache, tables, keys, values = prefill_case(torch.float32, seqlens_q, prefixes)
    with pytest.raises(ValueError, match=r"the reader of prefixes\[0\] must return two torch.float32 tensors of 10 "
                                         r"rows for tokens 0..9; got torch.float32 \(9, 2, 16\)"):
        prefill_attention(q, k, v, seqlens_q, seqlens_k, 0.3, prefixes={0: lambda a, b: (keys[0][:9], values[0][:9])})


@pytest.mark.parametrize("prefixes", [[5, 2, 0, 9, 3], [0, 0, 0, 0, 0], [0, 0, 4, 0, 0], [7, 0, 0, 0, 0]])
def test_packed_context_is_each_sequence_prefix_then_rows(prefixes):
    """The varlen prefill's packed keys/values (CUDA path, built on any device): per non-empty
    sequence, its cached prefix then its new rows."""
    from nanovllm.ops.prefill_attention import _packed_context, _sequences

    seqlens_q = [3, 0, 4, 1, 6]
    q, k, v, seqlens_k, k_cache, v_cache, tables, keys, values = prefill_case(torch.float32, seqlens_q, prefixes)
    seqs = list(_sequences(seqlens_q, seqlens_k))
    packed = _packed_context(k, v, k_cache, v_cache, seqs, tables, {})
    for got, new, full in zip(packed, (k, v), (keys, values)):
        assert torch.equal(got, torch.cat([full[i] for i, n in enumerate(seqlens_q) if n]))
        assert (got is new) == (not any(p for p, n in zip(prefixes, seqlens_q) if n))


@pytest.mark.parametrize("heads_q,heads_kv", [(3, 3), (6, 2), (8, 2)])
def test_decode_ref_matches_math(heads_q, heads_kv):
    contexts = [0, 1, 7, 13, 8]
    k_cache, v_cache, tables, keys, values = make_paged_cache(contexts, 4, heads_kv, 16, torch.float64)
    q = torch.randn(len(contexts), heads_q, 16, dtype=torch.float64)
    out = decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.25)
    assert (out[0] == 0).all()
    for b, n in enumerate(contexts[1:], start=1):
        expected, _ = naive_attention(q[b][None], keys[b], values[b], 0.25, False)
        assert_close(out[b], expected[0], 1e-10)


@pytest.mark.parametrize("heads_q,heads_kv", [(3, 3), (8, 2)])
def test_decode_ref_returns_lse_of_the_full_context(heads_q, heads_kv):
    contexts = [0, 1, 7, 13, 8]
    k_cache, v_cache, tables, keys, values = make_paged_cache(contexts, 4, heads_kv, 16, torch.float64)
    q = torch.randn(len(contexts), heads_q, 16, dtype=torch.float64)
    lens = torch.tensor(contexts, dtype=torch.int32)
    out, lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32 and lse.shape == (5, heads_q)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    for b, n in enumerate(contexts[1:], start=1):
        expected, expected_lse = naive_attention(q[b][None], keys[b], values[b], 0.25, False)
        assert_close(out[b], expected[0], 1e-10)
        torch.testing.assert_close(lse[b].double(), expected_lse[:, 0], atol=1e-5, rtol=1e-6)


def test_decode_lse_merges_two_block_ranges_into_the_whole_context():
    """What a tiered cache does: attention over blocks 0..1 and over blocks 2.. of each sequence,
    merged by LSE, equals attention over the whole context (out float32, not cast to bfloat16)."""
    contexts, block_size = [13, 9, 8, 20], 4
    k_cache, v_cache, tables, _, _ = make_paged_cache(contexts, block_size, 2, 16, torch.bfloat16)
    q = torch.randn(len(contexts), 6, 16).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32)
    head = (lens.clamp(max=2 * block_size), tables)
    tail = (lens - head[0], tables[:, 2:])
    o1, lse1 = decode_attention(q, k_cache, v_cache, head[1], head[0], 0.25, return_lse=True)
    o2, lse2 = decode_attention(q, k_cache, v_cache, tail[1], tail[0], 0.25, return_lse=True)
    assert o1.dtype == torch.float32 and torch.isneginf(lse2[2]).all()
    out, lse = merge_attention_outputs(o1[:, None], lse1[..., None], o2[:, None], lse2[..., None])
    full, full_lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.25, return_lse=True)
    assert_close(out[:, 0], full, 1e-5)
    torch.testing.assert_close(lse[..., 0], full_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(full.bfloat16(), decode_attention(q, k_cache, v_cache, tables, lens, 0.25))


def _fold_chunks(fold, q, keys, values, bounds, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:1], NEG_INF, dtype=torch.float32)
    for start, end in zip(bounds[:-1], bounds[1:]):
        fold(q, keys[start:end], values[start:end], out, lse, scale)
    return out, lse


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (6, 2), (20, 1)])
def test_decode_attend_merge_ref_folds_to_full_attention(heads_q, heads_kv):
    q, keys, values = torch.randn(heads_q, 64), torch.randn(90, heads_kv, 64), torch.randn(90, heads_kv, 64)
    out, lse = _fold_chunks(decode_attend_merge_ref, q, keys, values, [0, 1, 1, 40, 90], 0.125)
    ref_out, ref_lse = naive_attention(q[None], keys, values, 0.125, False)
    assert_close(out, ref_out[0], 1e-5)
    assert_close(lse, ref_lse[:, 0], 1e-5)


def test_rms_norm_ref_matches_float64_math_and_adds_the_residual():
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    out, new_res = rms_norm_ref(x, w, 1e-6, res)
    s = (x + res).double()
    expected = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close(out, expected, 1e-5)
    assert torch.equal(new_res, x + res)
    heads = torch.randn(3, 4, 64)  # per-head norm of [T, heads, D]
    assert_close(rms_norm_ref(heads, w, 1e-6), rms_norm_ref(heads.reshape(12, 64), w, 1e-6).reshape(3, 4, 64), 0)


def test_silu_and_mul_ref_matches_float64_math_rounded_once():
    x = torch.randn(5, 2 * 48, dtype=torch.float64) * 4
    want = x[:, :48] / (1 + torch.exp(-x[:, :48])) * x[:, 48:]
    assert_close(silu_and_mul_ref(x.float()), want.float(), 1e-6)
    half = silu_and_mul_ref(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(half, silu_and_mul_ref(x.to(torch.bfloat16).float()).to(torch.bfloat16))


def test_apply_rotary_ref_is_a_rotation_by_position_times_frequency():
    dim, positions = 8, torch.tensor([0, 3, 7])
    inv_freq = 1.0 / (100 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(10).float(), inv_freq)
    cache = torch.stack((angles.cos(), angles.sin()))
    q, k = torch.randn(3, 2, dim), torch.randn(3, 1, dim)
    q_rot, k_rot = apply_rotary_ref(positions, q, k, cache)
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        z = torch.complex(x[..., :dim // 2].double(), x[..., dim // 2:].double())
        z = z * torch.polar(torch.ones(3, 1, dim // 2, dtype=torch.float64), angles[positions].double()[:, None])
        assert_close(x_rot, torch.cat((z.real, z.imag), -1), 1e-6)
    assert torch.equal(q_rot[0], q[0])  # position 0 is the identity


ROTARY_VARIANTS = [(64, 64, False), (64, 24, False), (64, 32, True), (64, 40, True), (96, 96, False), (96, 48, True)]
"""(head_dim, rotary dims, interleaved): full and partial "rotate half" (Llama, Phi-3's head_dim 96),
GLM's interleaved half, an odd number of interleaved pairs (20)."""


def _variant_case(dtype, tokens: int, max_position: int, dim: int, rot: int, seed: int = 0):
    """A float32 cos/sin table of ``rot / 2`` pairs with an attention factor folded in (as
    LongRoPE's), q ``[tokens, 6, dim]`` / k ``[tokens, 2, dim]`` / v as strided views of one qkv
    buffer, and per-head norm weights."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / ((1 + torch.rand(rot // 2, generator=gen)) * 1e4 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    cache = torch.stack((angles.cos() * 1.2, angles.sin() * 1.2))
    qkv = (torch.randn(tokens, 10 * dim, generator=gen) * 4).to(dtype)
    q, k, v = (qkv[:, a * dim:b * dim].view(tokens, -1, dim) for a, b in ((0, 6), (6, 8), (8, 10)))
    qk_norm = ((torch.rand(dim, generator=gen) + 0.5).to(dtype), (torch.rand(dim, generator=gen) + 0.5).to(dtype), 1e-6)
    return cache, q, k, v, qk_norm


def _rotary_float64(x, cache, positions, interleaved):
    """Each rotary pair of ``x`` (float64) turned by its angle, as complex multiplication by
    ``cos + i sin`` of the table's (scaled) values; the dims past the table pass through."""
    rot = 2 * cache.shape[2]
    xr = x[..., :rot].double()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, -1)
    z = torch.complex(x1, x2) * torch.complex(cache[0, positions].double(), cache[1, positions].double())[:, None]
    y = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((y, x[..., rot:].double()), -1)


@pytest.mark.parametrize("dim,rot,interleaved", ROTARY_VARIANTS)
def test_apply_rotary_variants_match_float64_math(dim, rot, interleaved):
    """Partial and interleaved rotary, reference and CPU path, against float64 rotation of each
    pair; the dims past the rotary ones are the input's, bit for bit."""
    cache, q, k, _, _ = _variant_case(torch.float32, 7, 300, dim, rot)
    positions = torch.tensor([0, 1, 17, 299, 3, 150, 64])
    for rotate in (apply_rotary_ref, apply_rotary):
        for x, y in zip((q, k), rotate(positions, q, k, cache, interleaved=interleaved)):
            assert_close(y, _rotary_float64(x, cache, positions, interleaved), 1e-5)
            assert torch.equal(y[..., rot:], x[..., rot:])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(positions, q, k, torch.zeros(2, 300, dim // 2 + 1))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kvcache_ref_writes_slots_and_skips_minus_one(slot_dtype):
    k_cache, v_cache = torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([9, -1, 0, 19], dtype=slot_dtype)
    store_kvcache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 0], value[2])
    assert torch.equal(k_cache[4, 3], key[3]) and torch.equal(v_cache[4, 3], value[3])
    assert k_cache.count_nonzero() == 3 * 2 * 8


@eager_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_rotary_cpu_equals_reference_bit_for_bit(dtype):
    """The CPU path (x * [cos, cos] + [x2, x1] * [-sin, sin]) rounds like the reference."""
    dim = 64
    angles = torch.outer(torch.arange(300).float(), 1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim)))
    cache = torch.stack((angles.cos(), angles.sin()))
    qkv = (torch.randn(9, 10 * dim) * 4).to(dtype)
    q, k = qkv[:, :6 * dim].view(9, 6, dim), qkv[:, 6 * dim:8 * dim].view(9, 2, dim)
    positions = torch.tensor([0, 1, 17, 299, 3, 3, 150, 64, 2])
    for got, want in zip(apply_rotary(positions, q, k, cache), apply_rotary_ref(positions, q, k, cache)):
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)


def _rotary_case(dtype, tokens: int, max_position: int, dim: int = 64):
    """A cos/sin table, q ``[tokens, 6, dim]`` and k ``[tokens, 2, dim]`` as strided views of one
    qkv buffer, and per-head norm weights (Qwen3's q_norm / k_norm)."""
    angles = torch.outer(torch.arange(max_position).float(), 1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim)))
    qkv = (torch.randn(tokens, 10 * dim) * 4).to(dtype)
    q, k = qkv[:, :6 * dim].view(tokens, 6, dim), qkv[:, 6 * dim:8 * dim].view(tokens, 2, dim)
    qk_norm = ((torch.rand(dim) + 0.5).to(dtype), (torch.rand(dim) + 0.5).to(dtype), 1e-6)
    return torch.stack((angles.cos(), angles.sin())), q, k, qk_norm


@eager_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_with_qk_norm_cpu_is_norm_then_rotary(dtype):
    """Qwen3's q/k norm inside apply_rotary: on CPU the reference's result bit for bit, which is
    rms_norm_ref of every head followed by the plain rotation."""
    cache, q, k, qk_norm = _rotary_case(dtype, 9, 300)
    positions = torch.tensor([0, 1, 17, 299, 3, 3, 150, 64, 2])
    got = apply_rotary(positions, q, k, cache, qk_norm)
    want = apply_rotary_ref(positions, rms_norm_ref(q, qk_norm[0], 1e-6), rms_norm_ref(k, qk_norm[1], 1e-6), cache)
    for a, b, c in zip(got, want, apply_rotary_ref(positions, q, k, cache, qk_norm)):
        assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="qk_norm weights must be"):
        apply_rotary(positions, q, k, cache, (qk_norm[0][:32], qk_norm[1], 1e-6))


def _kv_store_case(dtype, v, slots):
    """A KVStore over empty (NaN) caches of 4 blocks x 4 slots, for the values ``v`` ``[N, 2, D]``."""
    caches = torch.full((2, 4, 4, *v.shape[1:]), float("nan"), dtype=dtype)
    return KVStore(v, caches[0], caches[1], torch.tensor(slots))


@eager_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_stores_rotated_keys_and_values_like_store_kvcache(dtype):
    """With a KVStore, apply_rotary also writes k' and v into their slots (a -1 slot skipped),
    exactly as store_kvcache of its own k' would; its q' and k' are unchanged by the store."""
    cache, q, k, qk_norm = _rotary_case(dtype, 5, 300)
    v = torch.randn(5, 2, 64).to(dtype)
    positions = torch.tensor([0, 1, 17, 299, 3])
    got_store, want_store = (_kv_store_case(dtype, v, [9, -1, 0, 15, 4]) for _ in range(2))
    got = apply_rotary(positions, q, k, cache, qk_norm, got_store)
    want = apply_rotary_ref(positions, q, k, cache, qk_norm)
    store_kvcache_ref(want[1], v, want_store.k_cache, want_store.v_cache, want_store.slot_mapping)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_store[1:3], want_store[1:3]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.equal(got_store.k_cache[2, 1], got[1][0]) and torch.equal(got_store.v_cache[3, 3], v[3])
    assert got_store.k_cache.isnan().sum() == (16 - 4) * 2 * 64  # 4 tokens stored, slot -1 skipped
    with pytest.raises(ValueError, match="slot_mapping must be"):
        apply_rotary(positions, q, k, cache, qk_norm, _kv_store_case(dtype, v, [0, 1]))


@eager_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,rot,interleaved", ROTARY_VARIANTS)
def test_apply_rotary_variants_cpu_equal_reference_bit_for_bit(dtype, dim, rot, interleaved):
    """Every variant on the CPU path rounds like the reference, plain and with the fused norm and
    store (a -1 slot skipped)."""
    cache, q, k, v, qk_norm = _variant_case(dtype, 5, 300, dim, rot)
    positions = torch.tensor([0, 1, 17, 299, 3])
    got = apply_rotary(positions, q, k, cache, interleaved=interleaved)
    for a, b in zip(got, apply_rotary_ref(positions, q, k, cache, interleaved=interleaved)):
        assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b)
    got_store, want_store = (_kv_store_case(dtype, v, [9, -1, 0, 15, 4]) for _ in range(2))
    got = apply_rotary(positions, q, k, cache, qk_norm, got_store, interleaved)
    want = apply_rotary_ref(positions, q, k, cache, qk_norm, want_store, interleaved)
    for a, b in zip(got + got_store[1:3], want + want_store[1:3]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@eager_only
def test_rms_norm_cpu_equals_reference_bit_for_bit():
    """float32 goes through torch's F.rms_norm: equal to the reference (with the residual, per
    head over a strided q view); bfloat16 keeps the reference's rounding steps."""
    w = torch.randn(96)
    for tokens in (1, 16, 300):
        x, res = torch.randn(tokens, 96) * 3, torch.randn(tokens, 96)
        out, new_res = rms_norm(x, w, 1e-5, res)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
        assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res)
        assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    q = torch.randn(5, 6 * 32)[:, :4 * 32].view(5, 4, 32)
    out = rms_norm(q, w[:32], 1e-6)
    assert out.is_contiguous() and torch.equal(out, rms_norm_ref(q, w[:32], 1e-6))
    xb, wb = torch.randn(4, 96).bfloat16(), w.bfloat16()
    assert torch.equal(rms_norm(xb, wb, 1e-6), rms_norm_ref(xb, wb, 1e-6))


@eager_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_cpu_is_the_torch_form(dtype):
    """CPU keeps torch's two ops (silu rounded to the dtype, then the product): equal to the
    reference for float32; otherwise each of the two roundings adds up to u (unit roundoff, 2**-8
    for bfloat16, 2**-11 for float16) against the reference's one, so they differ by 3u relative
    (plus second-order terms; 4u allowed)."""
    x = (torch.randn(6, 2 * 40) * 3).to(dtype)
    gate, up = x.chunk(2, -1)
    out = silu_and_mul(x)
    assert out.shape == (6, 40) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    ref = silu_and_mul_ref(x)
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    u = torch.finfo(dtype).eps / 2
    assert ((out.float() - ref.float()).abs() <= 4 * u * ref.float().abs() + 1e-6).all()
    with pytest.raises(ValueError, match=r"expected x \[T, 2 \* d\].*\(3, 5\)"):
        silu_and_mul(torch.randn(3, 5))


@eager_only
def test_store_kvcache_rejects_bad_slots_and_dtypes():
    """Slots must be int32/int64 and, off CUDA, inside -1..num_slots-1; every tensor floating point;
    a kv_store of apply_rotary must be a KVStore. Nothing is written when a check fails."""
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    key = value = torch.randn(5, 2, 16)
    for slots, message in ((torch.ones(5, dtype=torch.bool), "must be int32 or int64; got torch.bool"),
                           (torch.tensor([0.5, 1.7, 2, 3, 4]), "must be int32 or int64; got torch.float32"),
                           (torch.tensor([0, 1, 2, 3, 16]), r"slot_mapping\[4\]=16 is outside -1..15"),
                           (torch.tensor([0, 1, -1, 3, 16]), r"slot_mapping\[4\]=16 is outside -1..15"),
                           (torch.tensor([0, -2, 1, 2, 3]), r"slot_mapping\[1\]=-2 is outside -1..15")):
        with pytest.raises(ValueError, match=message):
            store_kvcache(key, value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="must be floating point"):
        store_kvcache(key, value, k_cache.long(), v_cache, torch.arange(5))
    assert k_cache.count_nonzero() == 0 and v_cache.count_nonzero() == 0
    cache, q, k, _ = _rotary_case(torch.float32, 5, 50, dim=16)
    with pytest.raises(ValueError, match="kv_store must be a KVStore"):
        apply_rotary(torch.arange(5), q, k, cache, None, (value, k_cache, v_cache, torch.arange(5)))


@eager_only
@pytest.mark.parametrize("slots", [[9, 0, 19, 4], [9, -1, 0, 19]], ids=["no-padding", "padding"])
@pytest.mark.parametrize("layout", ["engine", "strided-blocks"])
def test_store_kvcache_cpu_equals_reference(slots, layout):
    """The CPU path (index_copy_ into slot rows, used without -1 slots) writes what the reference
    writes, in place, from strided qkv views, casting to the cache dtype; a cache whose blocks
    are strided (the slot-row view does not exist) and padded slots take the reference."""
    caches = torch.zeros(2, 3, 10 if layout == "strided-blocks" else 5, 4, 2, 8)
    if layout == "strided-blocks":
        k_cache, v_cache = caches[0, 1, ::2], caches[1, 1, ::2]
    else:
        k_cache, v_cache = caches[0, 1], caches[1, 1]
    expected = caches.clone()
    qkv = torch.randn(4, 6, 8, dtype=torch.float64)
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    for dtype in (torch.int32, torch.int64):
        mapping = torch.tensor(slots, dtype=dtype)
        store_kvcache(key, value, k_cache, v_cache, mapping)
        exp_k, exp_v = (expected[0, 1, ::2], expected[1, 1, ::2]) if layout == "strided-blocks" else expected[:, 1]
        store_kvcache_ref(key, value, exp_k, exp_v, mapping)
        assert torch.equal(caches, expected) and caches.count_nonzero() > 0


@eager_only
def test_store_kvcache_cpu_rejects_a_slot_past_the_cache():
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]=8 is outside -1..7"):
        store_kvcache(torch.randn(2, 1, 8), torch.randn(2, 1, 8), cache, cache.clone(),
                      torch.tensor([3, 8], dtype=torch.int64))


def test_gather_kvcache_follows_block_table():
    cache = torch.arange(6 * 2 * 1 * 1, dtype=torch.float32).view(6, 2, 1, 1)
    rows = gather_kvcache(cache, torch.tensor([4, 1, -1], dtype=torch.int32), 3)
    assert rows.flatten().tolist() == [8.0, 9.0, 2.0]


def _host_pages(dtype=torch.float32):
    """One layer of a host tier viewed as pages (6 blocks of 2 pages of 8 tokens, layer-strided as
    in ``HostTier``), destination pages (a view of a two-layer tier) and (page, KV head) entries
    with skipped (-1) ones."""
    gen = torch.Generator().manual_seed(5)
    host = torch.randn(2, 3, 6, 16, 2, 8, generator=gen).to(dtype)  # [K/V, L, Nh, block, Hkv, D]
    rows = torch.randn(2, 2, 5, 16, 2, 8, generator=gen).to(dtype)
    src, heads = torch.tensor([4, -1, 0, 11, -1, 4]), torch.tensor([0, 1, 1, 0, 0, 1])
    dst = torch.tensor([2, 0, 9, 0, 3, 2], dtype=torch.int32)

    def pages(blocks):  # [blocks, 16, Hkv, D] -> [pages of 8 tokens, 8, Hkv, D], a view
        return blocks.view(-1, 8, 2, 8)

    return pages(host[0, 1]), pages(host[1, 1]), src, heads, rows, dst, pages


def test_gather_host_pages_ref_copies_the_listed_page_heads_only():
    src_k, src_v, src_pages, heads, rows, dst_pages, pages = _host_pages()
    before = rows.clone()
    gather_host_pages_ref(src_k, src_v, src_pages, heads, pages(rows[0, 1]), pages(rows[1, 1]), dst_pages)
    expected = before.clone()
    for s, h, d in ((4, 0, 2), (0, 1, 9), (11, 0, 0), (4, 1, 2)):
        pages(expected[0, 1])[d, :, h], pages(expected[1, 1])[d, :, h] = src_k[s, :, h], src_v[s, :, h]
    assert torch.equal(rows, expected), "skipped entries, other heads of a page and other layers untouched"


def test_gather_host_pages_checks_its_arguments():
    src_k, src_v, src_pages, heads, rows, dst_pages, pages = _host_pages()
    dst_k, dst_v = pages(rows[0, 0]), pages(rows[1, 0])
    with pytest.raises(ValueError, match="dst_k and dst_v must both be"):
        gather_host_pages(src_k, src_v, src_pages, heads, dst_k[:, :4], dst_v[:, :4], dst_pages)
    with pytest.raises(ValueError, match="share one dtype"):
        gather_host_pages(src_k, src_v, src_pages, heads, dst_k.double(), dst_v.double(), dst_pages)
    with pytest.raises(ValueError, match="int32 or int64"):
        gather_host_pages(src_k, src_v, src_pages.float(), heads, dst_k, dst_v, dst_pages)
    with pytest.raises(ValueError, match="must all be \\[n\\]"):
        gather_host_pages(src_k, src_v, src_pages[:2], heads, dst_k, dst_v, dst_pages)
    with pytest.raises(ValueError, match="contiguous last"):
        gather_host_pages(src_k.transpose(2, 3), src_v.transpose(2, 3), src_pages, heads, dst_k.transpose(2, 3),
                          dst_v.transpose(2, 3), dst_pages)


def _per_head_case(seed, batch=4, heads_q=8, heads_kv=2, dim=16, pages=40, page=4, width=7):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(pages, page, heads_kv, dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, heads_q, dim, generator=gen)
    tables = torch.stack([torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(heads_kv)])
                          for _ in range(batch)]).int()
    tables[0, 1, 2] = -1  # a page that reads nothing
    tables[2, 0] = -1  # a head with nothing to read
    lens = torch.tensor([width * page - 1, 5, width * page, 0][:batch], dtype=torch.int32)
    return q, k, v, tables, lens


def test_decode_per_head_tables_equal_each_heads_own_reference():
    """A table per KV head: each KV head and its query heads attend over their own pages; a -1
    entry reads nothing (its tokens masked), a head with no token reads zeros and LSE -inf. The
    CPU path equals the reference, and the reference equals the shared-table reference run per head."""
    q, k, v, tables, lens = _per_head_case(0)
    out, lse = decode_attention(q, k, v, tables, lens, 0.3, return_lse=True)
    ref_out, ref_lse = decode_attention_ref(q, k, v, tables, lens, 0.3, return_lse=True)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.equal(lse.isinf(), ref_lse.isinf())
    assert torch.allclose(lse[~lse.isinf()], ref_lse[~ref_lse.isinf()], atol=1e-5)
    assert (out[2, :4] == 0).all() and lse[2, :4].isneginf().all()
    for h in range(2):
        one = decode_attention_ref(q[:, 4 * h:4 * h + 4], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                   tables[:, h].contiguous(), lens, 0.3)
        assert torch.allclose(ref_out[:, 4 * h:4 * h + 4].to(one.dtype), one, atol=1e-6)
    shared = tables[:, :1].expand(-1, 2, -1).contiguous()
    assert torch.allclose(decode_attention(q, k, v, shared, lens, 0.3), decode_attention(q, k, v, shared[:, 0], lens, 0.3),
                          atol=1e-6), "every head reading one table is the shared-table decode"
    with pytest.raises(ValueError, match="per KV head"):
        decode_attention(q, k, v, tables[:, :1], lens, 0.3)


@interpreted_only
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_interpreted_decode_per_head_tables_match_reference(num_splits):
    for seed in range(2):
        q, k, v, tables, lens = _per_head_case(seed)
        out, lse = decode_attention(q, k, v, tables, lens, 0.3, num_splits=num_splits, return_lse=True)
        ref_out, ref_lse = decode_attention_ref(q, k, v, tables, lens, 0.3, return_lse=True)
        assert torch.allclose(out, ref_out, atol=1e-5)
        finite = ~ref_lse.isinf()
        assert torch.equal(finite, ~lse.isinf()) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


# ---------------------------------------------------------------- argument checks
def test_errors_name_the_value_and_the_limit():
    q = torch.randn(1, 2, 4, 300)
    with pytest.raises(ValueError, match="head_dim=300.*1..256"):
        flash_attn_with_lse(q, q[:, :, :2], q[:, :, :2], 1.0, False)
    with pytest.raises(ValueError, match="num_q_heads=3.*num_kv_heads=2"):
        flash_attn_with_lse(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), 1.0, False)
    with pytest.raises(ValueError, match="lse1 and lse2"):
        merge_attention_outputs(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3),
                                torch.randn(1, 2, 3, 8), torch.randn(1, 3, 2))
    with pytest.raises(ValueError, match="sum\\(seqlens_q\\)=5 != num_tokens=4"):
        prefill_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), [5], [5], 1.0)
    with pytest.raises(ValueError, match="seqlens_q=4 <= seqlens_k=3"):
        prefill_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), [4], [3], 1.0)
    with pytest.raises(ValueError, match="cached prefix of 2 tokens"):
        prefill_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), [4], [6], 1.0)
    with pytest.raises(ValueError, match="needs 3 blocks but block_tables has 2 columns"):
        cache = torch.randn(4, 4, 2, 8)
        prefill_attention(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8), [1], [10], 1.0,
                          cache, cache, torch.zeros(1, 2, dtype=torch.int32))
    cache = torch.randn(4, 4, 2, 8)
    with pytest.raises(ValueError, match="context_lens\\[1\\]=9 is outside 0..8"):
        decode_attention_ref(torch.randn(2, 4, 8), cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                             torch.tensor([1, 9], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="block_tables must be \\[B=2"):
        decode_attention(torch.randn(2, 4, 8), cache, cache, torch.zeros(3, 2, dtype=torch.int32),
                         torch.tensor([1, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="num_splits=0 must be >= 1"):
        decode_attention(torch.randn(2, 4, 8), cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                         torch.tensor([1, 2], dtype=torch.int32), 1.0, num_splits=0)
    with pytest.raises(ValueError, match="return_lse='yes' must be a bool"):
        decode_attention(torch.randn(2, 4, 8), cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                         torch.tensor([1, 2], dtype=torch.int32), 1.0, return_lse="yes")
    with pytest.raises(ValueError, match="slot_mapping must be \\[num_tokens=3\\]"):
        store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), cache, cache, torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------- CPU dispatch = references
@eager_only
def test_cpu_dispatch_uses_the_references():
    """CPU prefill runs torch's fused CPU attention (with the LSE) per sequence: equal to the
    plain-math reference within float32 rounding, GQA and a causal prefix split included.
    (CPU decode: the batched tests below.)"""
    q, kv = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    torch.testing.assert_close(prefill_attention(q, kv, kv, [4, 5], [4, 5], 0.25),
                               prefill_attention_ref(q, kv, kv, [4, 5], [4, 5], 0.25), atol=1e-5, rtol=1e-5)
    qb, kb = torch.randn(1, 5, 4, 16), torch.randn(1, 9, 2, 16)
    for got, want in zip(flash_attn_with_lse(qb, kb, kb, 0.25, True), flash_attn_with_lse_ref(qb, kb, kb, 0.25, True)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    o1, lse1, o2, lse2 = neg_inf_merge_inputs(torch.bfloat16)
    for a, b in zip(merge_attention_outputs(o1, lse1, o2, lse2), merge_attention_outputs_ref(o1, lse1, o2, lse2)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def poison_outside_contexts(cache, tables, contexts):
    """NaN in every cache slot that holds none of the contexts' tokens (tails of last blocks,
    spare blocks): a decode path that lets padding reach its output gives NaN."""
    block_size = cache.shape[1]
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(contexts):
        pos = torch.arange(n)
        keep[tables[b, pos // block_size].long(), pos % block_size] = True
    cache[~keep] = float("nan")


@eager_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("heads_q,heads_kv,block_size", [(4, 4, 4), (6, 2, 16), (9, 3, 256), (20, 1, 8)])
def test_cpu_decode_batched_matches_reference(dtype, tol, heads_q, heads_kv, block_size):
    """The batched CPU path (padded gather, GQA folded into the query rows) against the
    per-sequence reference: empty rows, one token, block edges, strided q rows; every cache slot
    outside the contexts holds NaN. float32 within 1e-5, the LSE too; half inputs compute in
    float32 (one rounding of the output, bfloat16 tolerance)."""
    contexts = [0, 1, 2 * block_size, 2 * block_size + 1, 37, 0, 3 * block_size - 1]
    k_cache, v_cache, tables, _, _ = make_paged_cache(contexts, block_size, heads_kv, 64, dtype)
    for cache in (k_cache, v_cache):
        poison_outside_contexts(cache, tables, contexts)
    lens = torch.tensor(contexts, dtype=torch.int32)
    q = (torch.randn(len(contexts), heads_q + 2 * heads_kv, 64) * 2).to(dtype)[:, :heads_q]
    out = decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.dtype == dtype
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), tol)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True)
    assert out.dtype == ref.dtype and lse.dtype == torch.float32
    assert_close(out, ref, min(tol, 1e-5))
    assert torch.isneginf(lse[[0, 5]]).all() and (out[[0, 5]] == 0).all()
    live = lens > 0
    torch.testing.assert_close(lse[live], ref_lse[live], atol=1e-5, rtol=1e-5)


@eager_only
def test_cpu_decode_is_one_fused_attention_call_for_the_batch():
    """A whole batch runs one torch fused-attention kernel (not one attention per sequence),
    also with no context at all, and rejects lengths outside the block table like the reference."""
    contexts = [3, 9, 1, 16]
    k_cache, v_cache, tables, _, _ = make_paged_cache(contexts, 4, 2, 16, torch.float32)
    lens, q = torch.tensor(contexts, dtype=torch.int32), torch.randn(4, 6, 16)
    with torch.profiler.profile() as prof:
        decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    names = [event.name for event in prof.events()]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1
    assert names.count("aten::index_select") == 2  # keys and values of every sequence, once
    out, lse = decode_attention(q, k_cache, v_cache, tables, torch.zeros(4, dtype=torch.int32), 0.25, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    for bad in (-1, tables.shape[1] * 4 + 1):
        with pytest.raises(ValueError, match=f"context_lens\\[2\\]={bad} is outside 0..{tables.shape[1] * 4}"):
            decode_attention(q, k_cache, v_cache, tables, torch.tensor([3, 9, bad, 16], dtype=torch.int32), 0.25)


# ---------------------------------------------------------------- Triton kernels (interpreter)
@interpreted_only
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_interpreted_store_kvcache(slot_dtype):
    layers = torch.randn(2, 3, 7, 4, 2, 64).bfloat16()
    expected = layers.clone()
    qkv = torch.randn(6, 8, 64).bfloat16()
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([5, -1, 27, 0, -1, 13], dtype=slot_dtype)
    store_kvcache(key, value, layers[0, 1], layers[1, 1], slots)
    store_kvcache_ref(key, value, expected[0, 1], expected[1, 1], slots)
    assert torch.equal(layers, expected)


@interpreted_only
def test_interpreted_merge_propagates_nan():
    check_nan_merge(merge_attention_outputs)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_merge_matches_reference(dtype):
    o1, lse1, o2, lse2 = neg_inf_merge_inputs(dtype)
    out, lse = merge_attention_outputs(o1, lse1, o2, lse2)
    check_neg_inf_merge(out, lse, o1, lse1, o2, lse2)
    ref_out, ref_lse = merge_attention_outputs_ref(o1, lse1, o2, lse2)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol, equal_nan=False)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


@interpreted_only
def test_interpreted_merge_of_a_float32_and_a_bf16_side():
    """A prefix attended in segments accumulates in float32 (prefill_attention): the kernel merges
    a float32 running output with a bf16 segment's and returns float32."""
    o1, lse1, o2, lse2 = neg_inf_merge_inputs(torch.float32)
    out, lse = merge_attention_outputs(o1, lse1, o2.bfloat16(), lse2)
    ref_out, ref_lse = merge_attention_outputs_ref(o1, lse1, o2.bfloat16().float(), lse2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


@interpreted_only
def test_interpreted_merge_of_strided_halves_equals_full_attention():
    q = torch.randn(1, 6, 5, 80)
    k, v = torch.randn(1, 10, 5, 80), torch.randn(1, 10, 5, 80)
    o1, lse1 = flash_attn_with_lse_ref(q, k[:, :4], v[:, :4], 0.1, False)
    o2, lse2 = flash_attn_with_lse_ref(q, k[:, 4:], v[:, 4:], 0.1, False)
    strided = o2.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = merge_attention_outputs(o1, lse1, strided, lse2)
    full_out, full_lse = flash_attn_with_lse_ref(q, k, v, 0.1, False)
    assert_close(out, full_out, 1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize(
    "heads_q,heads_kv,dim,block_size,num_splits",
    [(4, 4, 64, 16, None), (4, 2, 128, 32, 1), (6, 2, 64, 16, 3), (20, 1, 80, 8, 2), (8, 2, 64, 256, 40)],
)
def test_interpreted_decode_matches_reference(heads_q, heads_kv, dim, block_size, num_splits):
    contexts = [0, 1, 70, 2 * block_size + 3, 2 * block_size]
    k_cache, v_cache, tables, _, _ = make_paged_cache(contexts, block_size, heads_kv, dim, torch.float16)
    lens = torch.tensor(contexts, dtype=torch.int32)
    qkv = (torch.randn(len(contexts), heads_q + 2 * heads_kv, dim) * 3).half()
    q = qkv[:, :heads_q]
    out = decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, num_splits=num_splits)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, dim**-0.5)
    assert out.dtype == torch.float16 and (out[0] == 0).all()
    assert_close(out, ref, 2e-3)


@interpreted_only
@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, None), (torch.float32, 3), (torch.float16, 40)])
def test_interpreted_decode_returns_lse(dtype, num_splits):
    """The reduce kernel's LSE of the merged splits (splits past a short context are empty) and
    the float32 output before the cast; the default call returns that output cast to q.dtype."""
    contexts, block_size = [0, 1, 70, 35, 16], 16
    k_cache, v_cache, tables, _, _ = make_paged_cache(contexts, block_size, 2, 64, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32)
    q = (torch.randn(len(contexts), 6, 64) * 2).to(dtype)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits, return_lse=True)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (5, 6)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    default = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits)
    assert torch.equal(default, out.to(dtype))


@interpreted_only
def test_interpreted_decode_float32_is_exact_to_rounding():
    contexts = [33, 0, 5]
    k_cache, v_cache, tables, keys, values = make_paged_cache(contexts, 16, 2, 64, torch.float32)
    q = torch.randn(3, 6, 64)
    out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.125, num_splits=2)
    for b, n in enumerate(contexts):
        assert_close(out[b], naive_attention(q[b][None], keys[b], values[b], 0.125, False)[0][0], 1e-5)


@interpreted_only
def test_interpreted_decode_rescales_when_the_max_rises():
    """Scores grow with position, so every tile raises the running max (online-softmax rescale)."""
    length, block_size = 200, 16
    k_cache, v_cache, tables, _, _ = make_paged_cache([length], block_size, 2, 64, torch.float32)
    direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
    pos = torch.arange(length)
    rising = 0.1 * torch.randn(length, 2, 64) + (pos / length * 40)[:, None, None] * direction
    k_cache[tables[0, pos // block_size].long(), pos % block_size] = rising
    q = direction.repeat(1, 4, 1)
    lens = torch.tensor([length], dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=1)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), 1e-5)


@interpreted_only
def test_interpreted_prefill_with_prefix_matches_reference():
    seqlens_q, prefixes = [5, 0, 3, 7], [6, 4, 0, 13]
    q, k, v, seqlens_k, k_cache, v_cache, tables, _, _ = prefill_case(torch.bfloat16, seqlens_q, prefixes, block_size=8)
    out = prefill_attention(q, k, v, seqlens_q, seqlens_k, 0.25, k_cache, v_cache, tables)
    ref = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 0.25, k_cache, v_cache, tables)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, 2e-2)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads_q,heads_kv,dim", [(4, 2, 64), (20, 1, 80), (32, 8, 128)])
def test_interpreted_decode_attend_merge_matches_reference(dtype, heads_q, heads_kv, dim):
    """Chunks of 1, 63, 64 and 100 keys (tile edges), read from strided ring-slot views.
    (The interpreter computes bfloat16 tl.dot wrongly; bfloat16 runs in tests/gpu.)"""
    slots = torch.randn(2, 300, heads_kv + 3, dim).to(dtype)
    keys, values = slots[0, :, 1:1 + heads_kv], slots[1, :, 2:2 + heads_kv]
    q = (torch.randn(heads_q, dim) * 2).to(dtype)
    bounds = [0, 1, 64, 128, 228]
    out, lse = _fold_chunks(decode_attend_merge, q, keys, values, bounds, dim**-0.5)
    ref_out, ref_lse = _fold_chunks(decode_attend_merge_ref, q, keys, values, bounds, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, 1e-5 if dtype == torch.float32 else 1e-3)


@interpreted_only
@pytest.mark.parametrize("heads_q,heads_kv,dim", [(4, 2, 64), (32, 8, 128)])
def test_interpreted_split_fold_matches_reference(heads_q, heads_kv, dim):
    """Chunks of 1,000 and 4,096 keys over few KV heads: the keys are split into parts and merged by
    a second launch (``_split_plan``); a short chunk between them folds unsplit."""
    assert decode_merge._split_plan(heads_kv, 1000, 64)[0] > 1 and decode_merge._split_plan(heads_kv, 300, 64)[0] == 1
    keys, values = torch.randn(2, 5396, heads_kv, dim).unbind(0)
    q = torch.randn(heads_q, dim) * 2
    bounds = [0, 1000, 1300, 5396]
    out, lse = _fold_chunks(decode_attend_merge, q, keys, values, bounds, dim**-0.5)
    ref_out, ref_lse = _fold_chunks(decode_attend_merge_ref, q, keys, values, bounds, dim**-0.5)
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)


def test_fold_split_plan_fills_the_gpu_with_parts_of_whole_tiles():
    assert decode_merge._split_plan(8, 4096, 64) == (16, 256), "Llama-3.1-8B batch 1: 8 programs -> 128"
    assert decode_merge._split_plan(2, 1024, 64) == (4, 256), "at least 256 keys a part"
    assert decode_merge._split_plan(32, 4096, 64) == (1, 4096), "enough programs: one part"
    assert decode_merge._split_plan(1, 100_000, 64) == (32, 3136), "at most 32 parts, whole tiles"


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_rms_norm_matches_reference(dtype):
    x, res = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    out, new_res = rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    assert_close(out, ref_out, 1e-5 if dtype == torch.float32 else 1e-3)
    qkv = torch.randn(5, 6 * 32).to(dtype)  # per-head norm of a strided q view
    q = qkv[:, :4 * 32].view(5, 4, 32)
    assert_close(rms_norm(q, w[:32], 1e-6), rms_norm_ref(q, w[:32], 1e-6), 1e-5 if dtype == torch.float32 else 1e-3)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_apply_rotary_matches_reference(dtype):
    dim = 64
    angles = torch.outer(torch.arange(50).float(), 1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim)))
    cache = torch.stack((angles.cos(), angles.sin()))
    qkv = torch.randn(6, (6 + 2 * 2) * dim).to(dtype)
    q, k = qkv[:, :6 * dim].view(6, 6, dim), qkv[:, 6 * dim:8 * dim].view(6, 2, dim)
    positions = torch.tensor([0, 1, 17, 49, 3, 3])
    got, ref = apply_rotary(positions, q, k, cache), apply_rotary_ref(positions, q, k, cache)
    for a, b in zip(got, ref):
        assert a.is_contiguous() and a.dtype == dtype
        assert_close(a, b, 1e-6 if dtype == torch.float32 else 1e-3)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_apply_rotary_with_qk_norm_matches_reference(dtype):
    """The fused norm + rotation kernel against rms_norm_ref then the rotation (the mean square
    is summed in another order, so float16 may differ by a unit in the last place)."""
    cache, q, k, qk_norm = _rotary_case(dtype, 6, 50)
    positions = torch.tensor([0, 1, 17, 49, 3, 3])
    for a, b in zip(apply_rotary(positions, q, k, cache, qk_norm), apply_rotary_ref(positions, q, k, cache, qk_norm)):
        assert a.is_contiguous() and a.dtype == dtype
        assert_close(a, b, 1e-5 if dtype == torch.float32 else 2e-3)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_apply_rotary_with_kv_store_matches_reference(dtype):
    """The kernel's fused store: k' and v in their slots (a -1 slot skipped) as the reference
    (rotation, then store_kvcache_ref) writes them."""
    cache, q, k, qk_norm = _rotary_case(dtype, 5, 50)
    v = torch.randn(5, 2, 64).to(dtype)
    positions = torch.tensor([0, 1, 17, 49, 3])
    got_store, want_store = (_kv_store_case(dtype, v, [9, -1, 0, 15, 4]) for _ in range(2))
    got = apply_rotary(positions, q, k, cache, qk_norm, got_store)
    want = apply_rotary_ref(positions, q, k, cache, qk_norm, want_store)
    for a, b in zip(got + got_store[1:3], want + want_store[1:3]):
        assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), 1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(got_store.k_cache[2, 1], got[1][0]) and torch.equal(got_store.v_cache[3, 3], v[3])
    assert got_store.v_cache.isnan().sum() == (16 - 4) * 2 * 64


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim,rot,interleaved", ROTARY_VARIANTS[1:])
def test_interpreted_apply_rotary_variants_match_reference(dtype, dim, rot, interleaved):
    """The kernel's partial and interleaved rotation (head_dim 96: a masked 128-wide tile), plain
    against float64 math and the reference, and with the fused norm and store against the
    reference (the norm's mean square is summed in another order)."""
    cache, q, k, v, qk_norm = _variant_case(dtype, 5, 50, dim, rot)
    positions = torch.tensor([0, 1, 17, 49, 3])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = apply_rotary(positions, q, k, cache, interleaved=interleaved)
    for x, a, b in zip((q, k), got, apply_rotary_ref(positions, q, k, cache, interleaved=interleaved)):
        assert a.is_contiguous() and a.dtype == dtype
        assert_close(a, b, tol)
        assert torch.equal(a[..., rot:], x[..., rot:])
        if dtype == torch.float32:
            assert_close(a, _rotary_float64(x, cache, positions, interleaved), 1e-5)
    got_store, want_store = (_kv_store_case(dtype, v, [9, -1, 0, 15, 4]) for _ in range(2))
    got = apply_rotary(positions, q, k, cache, qk_norm, got_store, interleaved)
    want = apply_rotary_ref(positions, q, k, cache, qk_norm, want_store, interleaved)
    for a, b in zip(got + got_store[1:3], want + want_store[1:3]):
        assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), tol)
    assert torch.equal(got_store.k_cache[2, 1], got[1][0]) and torch.equal(got_store.v_cache[3, 3], v[3])
    assert got_store.v_cache.isnan().sum() == (16 - 4) * 2 * dim


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,d", [(1, 40), (5, 1100), (0, 64)])
def test_interpreted_silu_and_mul_matches_reference(dtype, tokens, d):
    """One rounding of float32 math, as the reference, to within one unit in the last place (the
    exp may differ by a float32 ulp); the 1,100 columns take a second, partly masked 1,024-column
    tile; rows of a wider strided buffer read in place."""
    packed = (torch.randn(tokens, 2 * d + 24) * 3).to(dtype)
    x = packed[:, 8:8 + 2 * d]
    out = silu_and_mul(x)
    assert out.shape == (tokens, d) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, silu_and_mul_ref(x), {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype])


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_gather_host_pages_matches_reference(dtype):
    """Bit for bit (a copy), int32 and int64 ids, skipped entries, two heads of one page."""
    src_k, src_v, src_pages, heads, rows, dst_pages, pages = _host_pages(dtype)
    expected = rows.clone()
    gather_host_pages_ref(src_k, src_v, src_pages, heads, pages(expected[0, 1]), pages(expected[1, 1]), dst_pages)
    gather_host_pages(src_k, src_v, src_pages, heads.int(), pages(rows[0, 1]), pages(rows[1, 1]), dst_pages.long())
    assert torch.equal(rows, expected)
    gather_host_pages(src_k, src_v, torch.full((3,), -1), torch.zeros(3, dtype=torch.int64), pages(rows[0, 0]),
                      pages(rows[1, 0]), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(rows, expected), "every entry skipped"


# ---------------------------------------------------------------- launcher of the above
@eager_only
def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=58)


def test_decode_split_plan_splits_only_an_under_filled_gpu():
    """On 132 SMs: >= 3 programs per SM run in one split; fewer aim at ~12 per SM, at most 32 splits
    and at least 256 token slots each; forced splits are kept."""
    module = importlib.import_module("nanovllm.ops.decode_attention")
    plan = module._split_plan
    cuda = torch.device("cuda", 0)
    original = module._sm_count
    module._sm_count = lambda device: 132
    try:
        assert plan(251 * 8, 4096, 64, cuda, None) == (1, 4096)
        assert plan(396, 4096, 64, cuda, None) == (1, 4096), "3 per SM: full"
        assert plan(48 * 8, 4096, 64, cuda, None) == (5, 832)
        assert plan(16 * 8, 4096, 64, cuda, None) == (13, 320)
        assert plan(8, 130_000, 64, cuda, None)[0] == 32
        assert plan(8, 512, 64, cuda, None) == (2, 256), "at least 256 slots per split"
        assert plan(251 * 8, 4096, 64, cuda, 4) == (4, 1024)
    finally:
        module._sm_count = original
