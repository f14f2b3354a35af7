"""CUDA paths of XAttention estimation (nanovllm.ops.xattn_estimate), the kept-block lists
(nanovllm.ops.block_lists) and block-sparse attention (nanovllm.ops.block_sparse_attention)
against their torch references at 8K-32K tokens, bf16,
Hq 32 / Hkv 8 (GQA 4:1), head_dim 64/128, 128-token blocks (and 64 / 256).
"""

import math

import pytest
import torch
from _gpu_util import assert_close

from nanovllm.ops import flash_attn_with_lse
from nanovllm.ops.block_lists import kept_block_lists, kept_block_lists_ref
from nanovllm.ops.block_sparse_attention import block_sparse_attention, block_sparse_attention_ref
from nanovllm.ops.xattn_estimate import xattn_block_scores, xattn_block_scores_ref
from nanovllm.ops.xattn_select import block_density, block_layout, xattn_select_blocks, xattn_select_blocks_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
BLOCK = 128


def qkv(seq_q, seq_k, heads_q=32, heads_kv=8, dim=128, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(seq_q, heads_q, dim, device=DEVICE, generator=gen)
    k = torch.randn(seq_k, heads_kv, dim, device=DEVICE, generator=gen)
    v = torch.randn(seq_k, heads_kv, dim, device=DEVICE, generator=gen)
    # Heavy keys give the attention (and the block scores) real structure.
    k[torch.randint(0, seq_k, (seq_k // 50,), device=DEVICE, generator=gen)] *= 4.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def assert_lse_close(lse, ref, atol=1e-2):
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert (lse[finite] - ref[finite]).abs().max() <= atol


@pytest.mark.parametrize(
    "seq_q, seq_k, dim, stride",
    [(8192, 8192, 128, 8), (8192, 8192, 64, 8), (16384, 16384, 128, 16), (32768, 32768, 128, 8),
     (4000, 20000, 128, 8), (4001, 20003, 128, 8)],
)
def test_block_scores_match_reference(seq_q, seq_k, dim, stride):
    q, k, _ = qkv(seq_q, seq_k, dim=dim)
    got = xattn_block_scores(q, k, stride, BLOCK, dim**-0.5)
    ref = xattn_block_scores_ref(q, k, stride, BLOCK, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-3
    lengths = dict(block_size=BLOCK, seq_q=seq_q, seq_k=seq_k)
    for threshold in (0.9, 0.95):
        mask = xattn_select_blocks(got, threshold, True, **lengths)
        ref_mask = xattn_select_blocks(ref, threshold, True, **lengths)
        # bf16 products accumulate in another order: only near-ties at the threshold may flip.
        assert (mask != ref_mask).float().mean() <= 1e-3
        assert abs(block_density(mask, True, **lengths) - block_density(ref_mask, True, **lengths)) <= 1e-2


def test_block_scores_float32_and_fp16():
    q, k, _ = qkv(4096, 6000, heads_q=8, heads_kv=2)
    for dtype in (torch.float32, torch.float16):
        got = xattn_block_scores(q.to(dtype), k.to(dtype), 8, BLOCK)
        ref = xattn_block_scores_ref(q.to(dtype), k.to(dtype), 8, BLOCK)
        assert (got - ref).abs().max() <= 1e-3


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("seq_q, seq_k", [(8192, 8192), (16384, 16384), (3000, 10000)])
def test_block_sparse_attention_matches_reference(dim, seq_q, seq_k):
    q, k, v = qkv(seq_q, seq_k, dim=dim, seed=1)
    lengths = dict(block_size=BLOCK, seq_q=seq_q, seq_k=seq_k)
    scores = xattn_block_scores(q, k, 8, BLOCK, dim**-0.5)
    mask = xattn_select_blocks(scores, 0.9, True, **lengths)
    mask[3, 2] = False  # a query block that sees nothing: out 0, lse -inf
    out, lse = block_sparse_attention(q, k, v, mask, BLOCK, dim**-0.5, True)
    ref_out, ref_lse = _float32_reference(q, k, v, mask, dim**-0.5, True)
    assert_close(out.float(), ref_out)
    assert_lse_close(lse, ref_lse)
    assert (out[2 * BLOCK : 3 * BLOCK, 3] == 0).all()


def _float32_reference(q, k, v, mask, scale, causal):
    """The reference on float32 copies of the bf16 inputs: ground truth for both kernels. (A
    bf16-rounded reference adds its own rounding: at |out| ~ 4 one bf16 step is 0.031, so two
    correct bf16 results can differ by 2 steps.)"""
    return block_sparse_attention_ref(q.float(), k.float(), v.float(), mask, BLOCK, scale, causal)


@pytest.mark.parametrize("seq_q, seq_k", [(16384, 16384), (5000, 9000)])
def test_block_sparse_attention_all_blocks_equals_dense(seq_q, seq_k):
    q, k, v = qkv(seq_q, seq_k, seed=2)
    visible, _ = block_layout(math.ceil(seq_q / BLOCK), math.ceil(seq_k / BLOCK), True, BLOCK, seq_q, seq_k, DEVICE)
    mask = visible.expand(32, *visible.shape).contiguous()
    out, lse = block_sparse_attention(q, k, v, mask, BLOCK, 128**-0.5, True)
    dense, dense_lse = flash_attn_with_lse(q[None], k[None], v[None], 128**-0.5, True)
    truth, truth_lse = _float32_reference(q, k, v, mask, 128**-0.5, True)
    for got, got_lse in ((out, lse), (dense[0], dense_lse[0])):  # both kernels equally close
        assert_close(got.float(), truth)
        assert_lse_close(got_lse, truth_lse)


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_block_sparse_attention_random_mask_non_causal(density):
    q, k, v = qkv(4096, 8192, seed=3)
    mask = torch.rand(32, 32, 64, device=DEVICE) < density
    out, lse = block_sparse_attention(q, k, v, mask, BLOCK, 128**-0.5, False)
    ref_out, ref_lse = _float32_reference(q, k, v, mask, 128**-0.5, False)
    assert_close(out.float(), ref_out)
    assert_lse_close(lse, ref_lse)


# ---------------------------------------------------------------- forced densities, other block sizes
def forced_density_mask(seq_q, seq_k, density, seed=0):
    """Random kept blocks among the causally visible ones, sink and diagonal always kept."""
    n_q, n_k = math.ceil(seq_q / BLOCK), math.ceil(seq_k / BLOCK)
    visible, forced = block_layout(n_q, n_k, True, BLOCK, seq_q, seq_k, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return ((torch.rand((32, n_q, n_k), device=DEVICE, generator=gen) < density) & visible) | forced


@pytest.mark.parametrize("dim, seq_q, seq_k", [(128, 8192, 8192), (64, 8192, 8192), (128, 3000, 10000),
                                               (128, 100, 5000)])
def test_block_sparse_attention_forced_density(dim, seq_q, seq_k):
    q, k, v = qkv(seq_q, seq_k, dim=dim, seed=1)
    mask = forced_density_mask(seq_q, seq_k, 0.3)
    empty = min(2, mask.shape[1] - 1)
    mask[3, empty] = False  # a query block that sees nothing: out 0, lse -inf
    out, lse = block_sparse_attention(q, k, v, mask, BLOCK, dim**-0.5, True)
    truth, truth_lse = _float32_reference(q, k, v, mask, dim**-0.5, True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(out.float(), truth)
    assert_lse_close(lse, truth_lse)
    assert (out[empty * BLOCK : (empty + 1) * BLOCK, 3] == 0).all()


@pytest.mark.parametrize("block", [64, 256])
def test_block_sparse_attention_other_block_sizes(block):
    """block 64: 64 x 64 tiles; block 256: two 128-key tiles per kept block."""
    q, k, v = qkv(3000, 5000, seed=4)
    mask = torch.rand(32, math.ceil(3000 / block), math.ceil(5000 / block), device=DEVICE) < 0.3
    out, lse = block_sparse_attention(q, k, v, mask, block, 128**-0.5, True)
    truth, truth_lse = block_sparse_attention_ref(q.float(), k.float(), v.float(), mask, block, 128**-0.5, True)
    assert_close(out.float(), truth)
    assert_lse_close(lse, truth_lse)


@pytest.mark.parametrize("seq_q, seq_k, causal", [(32768, 32768, True), (3000, 130000, True), (5000, 9000, False)])
def test_kept_block_lists_match_reference(seq_q, seq_k, causal):
    """The lists kernel gives the reference's counts and listed indices (nK up to 1,016)."""
    mask = forced_density_mask(seq_q, seq_k, 0.5)
    got = kept_block_lists(mask, BLOCK, seq_q, seq_k, causal)
    want = kept_block_lists_ref(mask, BLOCK, seq_q, seq_k, causal)
    for (count, index), (ref_count, ref_index) in zip((got[:2], got[2:]), (want[:2], want[2:])):
        assert torch.equal(count, ref_count)
        listed = torch.arange(index.shape[-1], device=DEVICE) < count[..., None]
        assert torch.equal(index[listed], ref_index[listed])


@pytest.mark.parametrize("seq_q, seq_k, causal", [(32768, 32768, True), (2048, 130000, True), (5000, 9000, False)])
def test_select_kernel_matches_reference(seq_q, seq_k, causal):
    """The selection kernel keeps exactly the reference's blocks on real estimation scores
    (nK up to 1,016, so sorts of 1,024 keys)."""
    q, k, _ = qkv(seq_q, seq_k, seed=6)
    scores = xattn_block_scores(q, k, 8, BLOCK, causal=causal)
    lengths = dict(block_size=BLOCK, seq_q=seq_q, seq_k=seq_k)
    for threshold in (0.5, 0.9, 0.95):
        got = xattn_select_blocks(scores, threshold, causal, **lengths)
        assert torch.equal(got, xattn_select_blocks_ref(scores, threshold, causal, **lengths)), threshold


def test_select_kernel_threshold_is_float64():
    """A Python float reaching Triton is float32; the kernel takes the threshold's float64 bits.
    Scores whose cumulative sum equals float32(0.9) are kept at 0.9 by the reference only if the
    comparison runs against 0.9 itself (and float32(1e-46) would be 0)."""
    np = pytest.importorskip("numpy")
    a = float(np.float32(0.9))
    b = float(np.float32(1 - np.float32(0.9)))
    for row, threshold in (([0.0, b, a, 0.0], 0.9), ([0.0, 0.7, 0.3, 0.0], 1e-46)):
        scores = torch.tensor([[row]], device=DEVICE)
        got = xattn_select_blocks(scores, threshold, False)
        assert torch.equal(got, xattn_select_blocks_ref(scores, threshold, False)), (row, threshold)
