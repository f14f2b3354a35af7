"""CUDA kernels of nanovllm.ops against their torch references at realistic sizes (bf16, head_dim
64/128, GQA 2:1-4:1, block_size 256, contexts up to 8K, decode batches up to 256)."""

import importlib
import math

import pytest
import torch
from _gpu_util import assert_close

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
from nanovllm.ops import chunked_attention

prefill_module = importlib.import_module("nanovllm.ops.prefill_attention")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
BLOCK_SIZE = 256
NEG_INF = float("-inf")
GQA = [(16, 8), (24, 8), (32, 8)]


def paged_cache(contexts, heads_kv, dim, dtype, pad_table=3):
    """Caches with every context in shuffled blocks, block tables (int32, -1 padded)."""
    counts = [math.ceil(n / BLOCK_SIZE) for n in contexts]
    num_blocks = sum(counts) + 5
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, heads_kv, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, heads_kv, dim, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(contexts), max(counts, default=0) + pad_table), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(counts):
        tables[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    return k_cache, v_cache, tables.to(DEVICE)


def test_store_kvcache_matches_reference():
    layers = torch.randn(2, 4, 40, BLOCK_SIZE, 8, 128, device=DEVICE).bfloat16()
    expected = layers.clone()
    qkv = torch.randn(5000, 48, 128, device=DEVICE).bfloat16()
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = torch.randperm(40 * BLOCK_SIZE, device=DEVICE)[:5000]
    slots[::17] = -1
    store_kvcache(key, value, layers[0, 2], layers[1, 2], slots.int())
    store_kvcache_ref(key, value, expected[0, 2], expected[1, 2], slots.int())
    assert torch.equal(layers, expected)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page", [16, 64])
def test_gather_host_pages_reads_a_pinned_host_tier_bit_for_bit(ids_dtype, page):
    """The source is one layer of a pinned CPU tier viewed as pages (read by the kernel through
    UVA), 4096-token blocks of 8 x 128 bf16, destinations pages of a layer-strided GPU tier;
    (page, KV head) entries on the device with skipped ones and two heads of one page."""
    host = torch.randn(2, 2, 12, 4096, 8, 128, dtype=torch.bfloat16).pin_memory()  # [K/V, L, Nh, ...]
    assert host.is_pinned()
    tier = torch.randn(2, 3, 6, 4096, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    per_block = 4096 // page
    src = torch.tensor([11 * per_block + 3, -1, 0, 7 * per_block, -1, 11 * per_block + 3], device=DEVICE,
                       dtype=ids_dtype)
    heads = torch.tensor([0, 1, 7, 3, 0, 5], device=DEVICE, dtype=ids_dtype)
    dst = torch.tensor([5, 0, 1, 4 * per_block + 2, 2, 5], device=DEVICE, dtype=ids_dtype)
    expected = tier.clone()

    def pages(t):
        return t.view(-1, page, 8, 128)

    gather_host_pages_ref(pages(host[0, 1]), pages(host[1, 1]), src, heads, pages(expected[0, 2]),
                          pages(expected[1, 2]), dst)
    gather_host_pages(pages(host[0, 1]), pages(host[1, 1]), src, heads, pages(tier[0, 2]), pages(tier[1, 2]), dst)
    torch.cuda.synchronize()
    assert torch.equal(tier, expected)
    assert torch.equal(pages(tier[0, 2])[5, :, 5].cpu(), pages(host[0, 1])[11 * per_block + 3, :, 5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [16, 32])
def test_decode_per_head_page_tables_match_reference(dtype, page):
    """The paged decode kernel reading a table of pages per KV head (the cache viewed as pages,
    -1 entries masked) equals the reference, and with every head reading the shared table equals
    the shared-table kernel: the page-level read costs nothing in accuracy."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    batch, heads_q, heads_kv, dim, pages, width = 16, 32, 8, 128, 4096, 96
    k, v = (torch.randn(pages, page, heads_kv, dim, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(batch, heads_q, dim, device=DEVICE, generator=gen).to(dtype)
    tables = torch.randint(0, pages, (batch, heads_kv, width), device=DEVICE, generator=gen, dtype=torch.int32)
    tables[0, 3, 10] = -1
    lens = torch.randint(1, width * page + 1, (batch,), device=DEVICE, generator=gen, dtype=torch.int32)
    for num_splits in (None, 1, 4):
        out, lse = decode_attention(q, k, v, tables, lens, dim**-0.5, num_splits=num_splits, return_lse=True)
        ref, ref_lse = decode_attention_ref(q, k, v, tables, lens, dim**-0.5, return_lse=True)
        assert_close(out, ref.float(), rel=1e-2, atol=2e-2)
        assert (lse - ref_lse).abs().max() <= 1e-2
    shared = tables[:, :1].expand(-1, heads_kv, -1).contiguous()
    assert_close(decode_attention(q, k, v, shared, lens, dim**-0.5), decode_attention(q, k, v, shared[:, 0], lens,
                                                                                     dim**-0.5), rel=1e-3, atol=1e-3)


@pytest.mark.parametrize("dim", [64, 128])
def test_merge_matches_reference_with_neg_inf(dim):
    o1 = torch.randn(2, 1024, 32, dim, device=DEVICE).bfloat16()
    o2 = torch.randn(2, 1024, 32, dim, device=DEVICE).bfloat16()
    lse1 = torch.randn(2, 32, 1024, device=DEVICE) * 5
    lse2 = torch.randn(2, 32, 1024, device=DEVICE) * 5
    lse1[0, :, :100] = NEG_INF
    o1[0, :100] = float("nan")
    lse2[1, 3, 500:] = NEG_INF
    lse1[1, 3, 900:] = NEG_INF
    out, lse = merge_attention_outputs(o1, lse1, o2, lse2)
    ref_out, ref_lse = merge_attention_outputs_ref(o1, lse1, o2, lse2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, :100], o2[0, :100]) and torch.equal(lse[0, :, :100], lse2[0, :, :100])
    assert (out[1, 900:, 3] == 0).all() and torch.isneginf(lse[1, 3, 900:]).all()
    assert_close(out, ref_out, rel=5e-3, atol=1.6e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads_q,heads_kv", GQA)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(1024, 1024), (300, 2048), (1, 777)])
def test_flash_attn_with_lse_matches_reference(dim, heads_q, heads_kv, causal, seq_q, seq_k):
    q = torch.randn(2, seq_q, heads_q, dim, device=DEVICE).bfloat16()
    k = torch.randn(2, seq_k, heads_kv, dim, device=DEVICE).bfloat16()
    v = torch.randn(2, seq_k, heads_kv, dim, device=DEVICE).bfloat16()
    out, lse = flash_attn_with_lse(q, k, v, dim**-0.5, causal)
    ref_out, ref_lse = flash_attn_with_lse_ref(q, k, v, dim**-0.5, causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, heads_q, seq_q)
    assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-3)
    assert not any(key[0] == "cudnn" for key in chunked_attention._failed_backends), chunked_attention._failed_backends


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_flash_attn_with_lse_other_dtypes(dtype):
    q = torch.randn(1, 200, 16, 128, device=DEVICE).to(dtype)
    k, v = torch.randn(1, 900, 8, 128, device=DEVICE).to(dtype), torch.randn(1, 900, 8, 128, device=DEVICE).to(dtype)
    out, lse = flash_attn_with_lse(q, k, v, 128**-0.5, True)
    ref_out, ref_lse = flash_attn_with_lse_ref(q, k, v, 128**-0.5, True)
    assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-3)


def new_token_slots(seqlens_q, prefixes, tables):
    """Flat cache slots of every sequence's new tokens (positions prefix .. prefix + n - 1)."""
    slots = []
    for i, (n, p) in enumerate(zip(seqlens_q, prefixes)):
        pos = torch.arange(p, p + n, device=DEVICE)
        slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    return torch.cat(slots)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads_q,heads_kv", GQA)
@pytest.mark.parametrize(
    "seqlens_q,prefixes",
    [([1000, 37, 1024, 1, 2048, 0], [0, 700, 7000, 8190, 1500, 300]),  # several: varlen launch
     ([300] * 24, [0] * 24),
     ([2000], [6000]), ([4096], [0]), ([2048, 1500], [0, 3000])],  # long ones: cuDNN per sequence
)
def test_prefill_attention_with_cached_prefix(dim, heads_q, heads_kv, seqlens_q, prefixes):
    seqlens_k = [n + p for n, p in zip(seqlens_q, prefixes)]
    k_cache, v_cache, tables = paged_cache(seqlens_k, heads_kv, dim, torch.bfloat16)
    q = torch.randn(sum(seqlens_q), heads_q, dim, device=DEVICE).bfloat16()
    k = torch.randn(sum(seqlens_q), heads_kv, dim, device=DEVICE).bfloat16()
    v = torch.randn(sum(seqlens_q), heads_kv, dim, device=DEVICE).bfloat16()
    store_kvcache(k, v, k_cache, v_cache, new_token_slots(seqlens_q, prefixes, tables))
    out = prefill_attention(q, k, v, seqlens_q, seqlens_k, dim**-0.5, k_cache, v_cache, tables)
    ref = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, dim**-0.5, k_cache, v_cache, tables)
    assert_close(out, ref)
    assert not prefill_module._varlen_failed


@pytest.mark.parametrize("seqlens_q,prefixes", [([2000], [6000]), ([600, 37, 300], [5000, 4100, 1500])],
                         ids=["one", "several"])
def test_prefill_attention_over_prefixes_of_several_segments(seqlens_q, prefixes, monkeypatch):
    """Segments of 1,024 tokens: each prefix gathered and attended by cuDNN a segment at a time,
    the outputs merged by LSE in float32 (the Triton merge of a float32 and a bf16 side); several
    short chunks whose prefixes exceed a segment leave the varlen launch for this path."""
    monkeypatch.setattr(prefill_module, "PREFIX_SEGMENT_BYTES", 1024 * 8 * 128 * 2)
    seqlens_k = [n + p for n, p in zip(seqlens_q, prefixes)]
    k_cache, v_cache, tables = paged_cache(seqlens_k, 8, 128, torch.bfloat16)
    q = torch.randn(sum(seqlens_q), 32, 128, device=DEVICE).bfloat16()
    k, v = (torch.randn(sum(seqlens_q), 8, 128, device=DEVICE).bfloat16() for _ in range(2))
    store_kvcache(k, v, k_cache, v_cache, new_token_slots(seqlens_q, prefixes, tables))
    out = prefill_attention(q, k, v, seqlens_q, seqlens_k, 128**-0.5, k_cache, v_cache, tables)
    ref = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 128**-0.5, k_cache, v_cache, tables)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads_q,heads_kv", GQA)
@pytest.mark.parametrize("batch,max_context", [(1, 8192), (4, 8192), (37, 3000), (256, 4096)])
def test_decode_attention_matches_reference(dim, heads_q, heads_kv, batch, max_context):
    contexts = torch.randint(0, max_context + 1, (batch,)).tolist()
    contexts[0] = max_context
    if batch > 1:
        contexts[1] = 0
    k_cache, v_cache, tables = paged_cache(contexts, heads_kv, dim, torch.bfloat16)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(batch, heads_q + 2 * heads_kv, dim, device=DEVICE).bfloat16()
    q = qkv[:, :heads_q]
    out = decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, dim**-0.5)
    assert_close(out, ref)
    if batch > 1:
        assert (out[1] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_attention_forced_splits_and_dtypes(num_splits, dtype):
    contexts = [0, 1, 255, 256, 257, 3001, 4096]
    k_cache, v_cache, tables = paged_cache(contexts, 8, 128, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(contexts), 32, 128, device=DEVICE).to(dtype)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, num_splits=num_splits)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, 128**-0.5)
    assert_close(out, ref, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_attention_returns_lse(num_splits, dtype):
    """The reduce kernel's merged LSE and float32 output against the reference; the default call
    returns exactly that output cast to q.dtype."""
    contexts = [0, 1, 255, 256, 257, 3001, 4096]
    k_cache, v_cache, tables = paged_cache(contexts, 8, 128, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(contexts), 32, 128, device=DEVICE).to(dtype)
    out, lse = decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, num_splits=num_splits, return_lse=True)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, tables, lens, 128**-0.5, return_lse=True)
    assert out.dtype == torch.float32 and lse.shape == (len(contexts), 32)
    assert_close(out, ref, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert_close(lse[1:], ref_lse[1:], rel=1e-4, atol=1e-3)
    default = decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, num_splits=num_splits)
    assert torch.equal(default, out.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads_q,heads_kv,dim", [(32, 8, 128), (16, 8, 64), (20, 1, 80)])
def test_decode_attend_merge_folds_ring_slots_like_the_reference(dtype, heads_q, heads_kv, dim):
    """Blocks of 4096, 1 and 1000 keys read from ring-slot views, folded into one state."""
    slots = torch.randn(2, 3, 4096, heads_kv, dim, device=DEVICE).to(dtype)
    q = torch.randn(heads_q, dim, device=DEVICE).to(dtype)
    states = []
    for fold in (decode_attend_merge, decode_attend_merge_ref):
        out = torch.zeros(heads_q, dim, device=DEVICE)
        lse = torch.full((heads_q,), NEG_INF, device=DEVICE)
        for slot, n in enumerate((4096, 1, 1000)):
            fold(q, slots[0, slot, :n], slots[1, slot, :n], out, lse, dim**-0.5)
        states.append((out, lse))
    (out, lse), (ref_out, ref_lse) = states
    assert_close(out, ref_out, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert_close(lse, ref_lse, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,dim", [(1, 1024), (300, 4096), (7, 576)])
def test_rms_norm_matches_reference(dtype, tokens, dim):
    x, res = torch.randn(tokens, dim, device=DEVICE).to(dtype), torch.randn(tokens, dim, device=DEVICE).to(dtype)
    w = torch.randn(dim, device=DEVICE).to(dtype)
    out, new_res = rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    assert_close(out, ref_out, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    q = torch.randn(tokens, 48 * 128, device=DEVICE).to(dtype)[:, :32 * 128].view(tokens, 32, 128)
    assert_close(rms_norm(q, w[:128], 1e-6), rms_norm_ref(q, w[:128], 1e-6), rel=1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_matches_reference(dtype):
    dim, tokens = 128, 333
    angles = torch.outer(torch.arange(8192, device=DEVICE).float(), 1.0 / (5e5 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim)))
    cache = torch.stack((angles.cos(), angles.sin()))
    qkv = torch.randn(tokens, 48 * dim, device=DEVICE).to(dtype)
    q, k = qkv[:, :32 * dim].view(tokens, 32, dim), qkv[:, 32 * dim:40 * dim].view(tokens, 8, dim)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    for got, ref in zip(apply_rotary(positions, q, k, cache), apply_rotary_ref(positions, q, k, cache)):
        assert_close(got, ref, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_with_qk_norm_matches_reference(dtype):
    """Qwen3's per-head q/k RMSNorm fused into the RoPE launch, against rms_norm_ref then the
    rotation (Qwen3-0.6B's heads: 16/8 x 128)."""
    dim, tokens = 128, 333
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    angles = torch.outer(torch.arange(8192, device=DEVICE).float(), inv_freq)
    cache = torch.stack((angles.cos(), angles.sin()))
    qkv = torch.randn(tokens, 32 * dim, device=DEVICE).mul_(4).to(dtype)
    q, k = qkv[:, :16 * dim].view(tokens, 16, dim), qkv[:, 16 * dim:24 * dim].view(tokens, 8, dim)
    qk_norm = ((torch.rand(dim, device=DEVICE) + 0.5).to(dtype), (torch.rand(dim, device=DEVICE) + 0.5).to(dtype), 1e-6)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    expected = apply_rotary_ref(positions, q, k, cache, qk_norm)
    for got, ref in zip(apply_rotary(positions, q, k, cache, qk_norm), expected):
        assert_close(got, ref, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_kv_store_equals_rotary_then_store_kvcache(dtype):
    """The store fused into the RoPE launch writes the cache bit for bit as apply_rotary followed
    by store_kvcache (Qwen3-0.6B's heads, 256-token blocks, padding slots of -1 skipped)."""
    dim, tokens = 128, 333
    angles = torch.outer(torch.arange(8192, device=DEVICE).float(), 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim)))
    cache = torch.stack((angles.cos(), angles.sin()))
    qkv = torch.randn(tokens, 32 * dim, device=DEVICE).mul_(4).to(dtype)
    q, k, v = (qkv[:, a * dim:b * dim].view(tokens, -1, dim) for a, b in ((0, 16), (16, 24), (24, 32)))
    qk_norm = ((torch.rand(dim, device=DEVICE) + 0.5).to(dtype), (torch.rand(dim, device=DEVICE) + 0.5).to(dtype), 1e-6)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    slots = torch.randperm(8 * 256, device=DEVICE)[:tokens].int()
    slots[::7] = -1
    fused, separate = (torch.full((2, 8, 256, 8, dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    got = apply_rotary(positions, q, k, cache, qk_norm, KVStore(v, fused[0], fused[1], slots))
    want = apply_rotary(positions, q, k, cache, qk_norm)
    store_kvcache(want[1], v, separate[0], separate[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(fused.nan_to_num(7.0), separate.nan_to_num(7.0))
    assert fused.isnan().sum() == (8 * 256 - (slots >= 0).sum()) * 2 * 8 * dim


def _rope_case(shape: str, dtype, tokens: int):
    """The RoPE table and q/k/v of a real model's heads, the table built by RotaryEmbedding:
    GLM-4-9B-chat-1m (32 q / 4 kv heads x 128, the first 64 dims rotated in interleaved pairs,
    theta 1e8) or Phi-3-mini-128k (32 / 32 heads x 96, LongRoPE: an 8K engine past the original
    4K context takes the long factors and the attention factor sqrt(1 + ln 32 / ln 4096))."""
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    if shape == "glm":
        heads_q, heads_kv, dim, interleaved = 32, 4, 128, True
        params = {"rope_type": "default", "rope_theta": 1e8, "partial_rotary_factor": 0.5}
    else:
        heads_q, heads_kv, dim, interleaved = 32, 32, 96, False
        params = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 1.0,
                  "short_factor": (1 + 2 * torch.rand(48, generator=gen)).sort().values.tolist(),
                  "long_factor": (1 + 63 * torch.rand(48, generator=gen)).sort().values.tolist(),
                  "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    rope = RotaryEmbedding(dim, 8192, params, interleaved).to(DEVICE)
    qkv = torch.randn(tokens, (heads_q + 2 * heads_kv) * dim, device=DEVICE).mul_(4).to(dtype)
    q, k, v = (qkv[:, a * dim:b * dim].view(tokens, -1, dim)
               for a, b in ((0, heads_q), (heads_q, heads_q + heads_kv), (heads_q + heads_kv, heads_q + 2 * heads_kv)))
    return rope.cos_sin_cache, interleaved, q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["glm", "phi3"])
def test_apply_rotary_partial_interleaved_longrope_matches_reference(dtype, shape):
    """GLM's partial interleaved RoPE and Phi-3's LongRoPE table against the reference, the
    dims past the rotary ones passed through unchanged, and the fused store writing what
    store_kvcache writes (256-token blocks, padding slots of -1 skipped)."""
    tokens = 333
    cache, interleaved, q, k, v = _rope_case(shape, dtype, tokens)
    rot = 2 * cache.shape[2]
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    got = apply_rotary(positions, q, k, cache, interleaved=interleaved)
    for x, a, b in zip((q, k), got, apply_rotary_ref(positions, q, k, cache, interleaved=interleaved)):
        if dtype == torch.bfloat16:  # one rounding apart: up to an ulp of the largest value (LongRoPE scales it up)
            assert_close(a, b, rel=1e-2, atol=float(b.abs().max()) * 2.0**-7)
        else:
            assert_close(a, b, rel=1e-5)
        assert torch.equal(a[..., rot:], x[..., rot:])
    slots = torch.randperm(8 * 256, device=DEVICE)[:tokens].int()
    slots[::7] = -1
    fused, separate = (torch.full((2, 8, 256, k.shape[1], k.shape[2]), float("nan"), dtype=dtype, device=DEVICE)
                       for _ in range(2))
    stored = apply_rotary(positions, q, k, cache, None, KVStore(v, fused[0], fused[1], slots), interleaved)
    assert all(torch.equal(a, b) for a, b in zip(stored, got))
    store_kvcache(got[1], v, separate[0], separate[1], slots)
    assert torch.equal(fused.nan_to_num(7.0), separate.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_interleaved_with_qk_norm_matches_reference(dtype):
    """The fused per-head norm with a partial interleaved rotation (GLM's heads): the norm covers
    every dim of the head, the rotation only the first half."""
    tokens = 333
    cache, _, q, k, _ = _rope_case("glm", dtype, tokens)
    qk_norm = ((torch.rand(128, device=DEVICE) + 0.5).to(dtype), (torch.rand(128, device=DEVICE) + 0.5).to(dtype), 1e-6)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    expected = apply_rotary_ref(positions, q, k, cache, qk_norm, interleaved=True)
    for got, ref in zip(apply_rotary(positions, q, k, cache, qk_norm, interleaved=True), expected):
        assert_close(got, ref, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


def _silu_tolerance(dtype):
    """Relative bound of the kernel vs :func:`silu_and_mul_ref`: one unit in the last place (2u,
    u the unit roundoff) for bfloat16/float16; for float32 the GPU's approximate exp2 and division
    (a few float32 ulps, times |gate| <= 20 through exp's argument)."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,d", [(1, 3072), (256, 3072), (37, 1536), (5, 1100), (0, 3072)])
def test_silu_and_mul_matches_reference(dtype, tokens, d):
    """The fused kernel rounds float32 math once, as the reference. Against the old torch form
    (silu rounded, then the product rounded) it differs by 3u relative (u = 2**-8 bfloat16,
    2**-11 float16; plus second-order terms, 4u allowed). Rows of a strided buffer (the gate/up
    part of a wider projection) are read in place."""
    packed = torch.randn(tokens, 2 * d + 64, device=DEVICE).mul_(3).to(dtype)
    x = packed[:, 64:]
    out = silu_and_mul(x)
    assert out.is_contiguous() and out.shape == (tokens, d) and out.dtype == dtype
    ref = silu_and_mul_ref(x).float()
    assert ((out.float() - ref).abs() <= _silu_tolerance(dtype) * ref.abs() + 1e-6).all()
    gate, up = x.chunk(2, -1)
    old = (torch.nn.functional.silu(gate) * up).float()
    u = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    assert ((out.float() - old).abs() <= (4 * u + 1e-5) * ref.abs() + 1e-6).all()


def test_silu_and_mul_cuda_graph_replay():
    """Captured once, replayed on new inputs in the same buffer (the decode graph's use)."""
    x = torch.randn(64, 2 * 3072, device=DEVICE, dtype=torch.bfloat16)
    silu_and_mul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = silu_and_mul_ref(x).float()
    assert ((out.float() - ref).abs() <= _silu_tolerance(torch.bfloat16) * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_attention_cuda_graph_replay(return_lse):
    batch, heads_q, heads_kv, dim, max_blocks = 64, 32, 8, 128, 16
    k_cache, v_cache, _ = paged_cache([max_blocks * BLOCK_SIZE] * batch, heads_kv, dim, torch.bfloat16)
    q = torch.randn(batch, heads_q, dim, device=DEVICE).bfloat16()
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, return_lse=return_lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, return_lse=return_lse)
    for _ in range(2):
        contexts = torch.randint(0, max_blocks * BLOCK_SIZE + 1, (batch,))
        contexts[::9] = 0
        q.copy_(torch.randn_like(q))
        tables.copy_(torch.stack([torch.randperm(k_cache.shape[0])[:max_blocks] for _ in range(batch)]).int())
        lens.copy_(contexts.int())
        graph.replay()
        ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, dim**-0.5, return_lse=return_lse)
        if return_lse:
            (out, lse), (ref, ref_lse) = result, ref
            live = contexts.to(DEVICE) > 0
            assert_close(lse[live], ref_lse[live], rel=1e-4, atol=1e-3)
            assert torch.isneginf(lse[::9]).all()
        else:
            out = result
        assert_close(out, ref)
        assert (out[::9] == 0).all()


# ---------------------------------------------------------------- sliding windows
def windowed_tables(contexts, tables, window):
    """The decode rows of a sliding window (as ``kvcache/window.py`` builds them): each table from the
    window's first block, its tokens from there and its start (tokens of that block before the window)."""
    cut, lens, starts = torch.full_like(tables, -1), [], []
    for b, n in enumerate(contexts):
        first = max(0, n - window) if n else 0
        fb = first // BLOCK_SIZE
        cut[b, :tables.shape[1] - fb] = tables[b, fb:]
        lens.append(n - fb * BLOCK_SIZE)
        starts.append(first - fb * BLOCK_SIZE)
    return (cut, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            torch.tensor(starts, dtype=torch.int32, device=DEVICE))


def poison_before_windows(cache, contexts, tables, window):
    """NaN in every slot before a row's window: a kernel that read one would show it."""
    for b, n in enumerate(contexts):
        pos = torch.arange(max(0, n - window), device=DEVICE)
        cache[tables[b, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE] = float("nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("window,batch,max_context", [(4096, 1, 32768), (4096, 37, 20000), (300, 256, 4096),
                                                      (1000, 64, 8192)])
def test_decode_attention_in_a_window_matches_reference(dtype, num_splits, window, batch, max_context):
    """Tables cut to each window's blocks, ``context_starts`` inside the first; every slot before a
    window is NaN (never read), rows with no context give 0 and lse -inf."""
    contexts = torch.randint(1, max_context + 1, (batch,)).tolist()
    contexts[0] = max_context
    if batch > 2:
        contexts[1], contexts[2] = 0, window - 1
    k_cache, v_cache, tables = paged_cache(contexts, 8, 128, dtype)
    poison_before_windows(k_cache, contexts, tables, window)
    cut, lens, starts = windowed_tables(contexts, tables, window)
    q = torch.randn(batch, 32, 128, device=DEVICE).to(dtype)
    out, lse = decode_attention(q, k_cache, v_cache, cut, lens, 128**-0.5, num_splits=num_splits, return_lse=True,
                                context_starts=starts)
    ref, ref_lse = decode_attention_ref(q, k_cache, v_cache, cut, lens, 128**-0.5, return_lse=True,
                                        context_starts=starts)
    assert_close(out, ref, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    live = lens > 0
    assert_close(lse[live], ref_lse[live], rel=1e-4, atol=1e-3)
    if batch > 2:
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_decode_attention_in_a_window_cuda_graph_replay():
    """Captured with window buffers (tables as wide as the window's span), replayed on new rows."""
    batch, window = 64, 4096
    width = (window + BLOCK_SIZE - 2) // BLOCK_SIZE + 1
    k_cache, v_cache, _ = paged_cache([64 * BLOCK_SIZE] * 2, 8, 128, torch.bfloat16)
    q = torch.randn(batch, 32, 128, device=DEVICE).bfloat16()
    tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, context_starts=starts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, context_starts=starts)
    for _ in range(2):
        contexts = torch.randint(1, 40000, (batch,)).tolist()
        full = torch.randint(0, k_cache.shape[0], (batch, 160), dtype=torch.int32, device=DEVICE)
        cut, new_lens, new_starts = windowed_tables(contexts, full, window)
        q.copy_(torch.randn_like(q))
        tables.copy_(cut[:, :width])
        lens.copy_(new_lens)
        starts.copy_(new_starts)
        graph.replay()
        assert_close(out, decode_attention_ref(q, k_cache, v_cache, tables, lens, 128**-0.5, context_starts=starts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [300, 4096])
@pytest.mark.parametrize("seqlens_q,prefixes", [([1000, 37, 1024, 1, 2048, 0], [0, 700, 7000, 8190, 1500, 300]),
                                                ([8192], [0]), ([2000], [6000])])
def test_prefill_attention_in_a_window_matches_reference(dtype, window, seqlens_q, prefixes):
    """bf16: one varlen FlashAttention-2 launch with its window (which must not fail); float32: query
    tiles through SDPA; the cached slots before every chunk's window are NaN."""
    seqlens_k = [n + p for n, p in zip(seqlens_q, prefixes)]
    k_cache, v_cache, tables = paged_cache(seqlens_k, 8, 128, dtype)
    for b, p in enumerate(prefixes):
        pos = torch.arange(max(0, p - window + 1), device=DEVICE)
        k_cache[tables[b, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE] = float("nan")
    q = torch.randn(sum(seqlens_q), 32, 128, device=DEVICE).to(dtype)
    k = torch.randn(sum(seqlens_q), 8, 128, device=DEVICE).to(dtype)
    v = torch.randn(sum(seqlens_q), 8, 128, device=DEVICE).to(dtype)
    store_kvcache(k, v, k_cache, v_cache, new_token_slots(seqlens_q, prefixes, tables))
    out = prefill_attention(q, k, v, seqlens_q, seqlens_k, 128**-0.5, k_cache, v_cache, tables, sliding_window=window)
    ref = prefill_attention_ref(q, k, v, seqlens_q, seqlens_k, 128**-0.5, k_cache, v_cache, tables,
                                sliding_window=window)
    assert_close(out, ref, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert not prefill_module._varlen_failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [1, 300, 4096])
def test_block_sparse_attention_in_a_window_matches_reference(dtype, window):
    """Blocks kept at random (each query block's diagonal kept): the window drops blocks before it
    and masks the keys across its edge, in the kernel as in the reference."""
    from nanovllm.ops import block_sparse_attention, block_sparse_attention_ref

    seq_q, seq_k, block = 4096, 8192, 128
    q = torch.randn(seq_q, 32, 128, device=DEVICE).to(dtype)
    k, v = (torch.randn(seq_k, 8, 128, device=DEVICE).to(dtype) for _ in range(2))
    mask = torch.rand(32, seq_q // block, seq_k // block, device=DEVICE) < 0.5
    diagonal = torch.arange(seq_q // block, device=DEVICE)
    mask[:, diagonal, diagonal + (seq_k - seq_q) // block] = True
    out, lse = block_sparse_attention(q, k, v, mask, block, 128**-0.5, window=window)
    ref, ref_lse = block_sparse_attention_ref(q, k, v, mask, block, 128**-0.5, window=window)
    assert_close(out, ref, rel=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert_close(lse, ref_lse, rel=1e-4, atol=1e-3)
