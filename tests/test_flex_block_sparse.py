"""CPU tests of the FlexAttention backend of block-sparse attention
(nanovllm.ops.flex_block_sparse) against the torch reference (block_sparse_attention_ref) and
dense attention.

On CPU flex_attention runs its eager path, which applies the mask_mod to every score and ignores
the block lists; so the lists (what the CUDA kernel walks) are checked separately, by rebuilding
the token mask the kernel computes from them (full blocks: every key; partial blocks: the
mask_mod). The compiled CUDA kernel is compared in tests/gpu/test_xattn_gpu.py.
"""

import inspect
import math
import sys

import pytest
import torch
import torch.nn.attention

pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention needs PyTorch 2.5+")

from _util import random_qk  # noqa: E402

from nanovllm.ops import flash_attn_with_lse_ref  # noqa: E402
from nanovllm.ops import flex_block_sparse as fbs  # noqa: E402
from nanovllm.ops.block_sparse_attention import block_sparse_attention_ref  # noqa: E402
from nanovllm.ops.flex_block_sparse import flex_block_lists, flex_block_sparse_attention  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (Sq, Sk, Hq, Hkv, D, block_size, causal): GQA 4:1 and 1:1, head_dim 64/128, lengths that are
# not block multiples, Sq < Sk with an unaligned offset, Sq > Sk (early rows see no key), one
# query block (nQ = 1) and one key block (nK = 1).
CASES = [
    (100, 300, 4, 1, 64, 32, True),
    (200, 200, 2, 2, 128, 64, True),
    (130, 333, 4, 1, 128, 32, False),
    (96, 64, 2, 1, 64, 32, True),
    (20, 90, 4, 1, 64, 32, True),
    (20, 30, 2, 2, 64, 32, False),
]


def make_inputs(seq_q, seq_k, heads_q, heads_kv, dim, block_size, density=0.5, dtype=torch.float32, seed=0):
    q, k = random_qk(seq_q, seq_k, heads_q, heads_kv, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(seq_k, heads_kv, dim, generator=gen).to(dtype)
    shape = (heads_q, math.ceil(seq_q / block_size), math.ceil(seq_k / block_size))
    mask = torch.rand(shape, generator=gen) < density
    mask[-1, 0] = False  # a query block that keeps nothing: out 0, lse -inf
    return q, k, v, mask


def assert_close(actual, expected, tol):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not torch.isnan(actual).any()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    err = (actual.double()[finite] - expected.double()[finite]).abs().max() if finite.any() else 0.0
    assert err <= tol, f"max error {float(err):.3e} > {tol}"


def token_mask(mask, block_size, seq_q, seq_k, causal):
    """bool [Hq, Sq, Sk]: what query row i may see (the contract)."""
    tokens = mask.repeat_interleave(block_size, 1)[:, :seq_q].repeat_interleave(block_size, 2)[:, :, :seq_k]
    if causal:
        rows = torch.arange(seq_q)[:, None] + seq_k - seq_q
        tokens = tokens & (torch.arange(seq_k)[None, :] <= rows)
    return tokens


def listed_blocks(count, index, n_k):
    """bool [Hq, nQ, nK] of the blocks a flex (count [1, Hq, nQ], index [1, Hq, nQ, nK]) pair lists."""
    valid = torch.arange(index.shape[-1]) < count[0, ..., None]
    dense = torch.zeros(*index.shape[1:-1], n_k + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(valid, index[0].long(), n_k), True)
    return dense[..., :n_k]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    seq_q, seq_k, heads_q, heads_kv, dim, block, causal = case
    q, k, v, mask = make_inputs(seq_q, seq_k, heads_q, heads_kv, dim, block)
    out, lse = flex_block_sparse_attention(q, k, v, mask, block, dim**-0.5, causal)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, block, dim**-0.5, causal)
    assert out.is_contiguous() and lse.shape == (heads_q, seq_q)
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
    assert (out[: min(block, seq_q), -1] == 0).all() and torch.isneginf(lse[-1, : min(block, seq_q)]).all()


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_low_precision_matches_reference(dtype, tol):
    q, k, v, mask = make_inputs(100, 300, 4, 1, 64, 32, dtype=dtype, seed=3)
    out, lse = flex_block_sparse_attention(q, k, v, mask, 32)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, 32)
    assert out.dtype == dtype
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("heads_q, heads_kv, dim, seq_q, seq_k", [(4, 1, 64, 150, 333), (2, 2, 128, 200, 200)])
def test_all_blocks_equals_dense_causal(heads_q, heads_kv, dim, seq_q, seq_k):
    q, k, v, _ = make_inputs(seq_q, seq_k, heads_q, heads_kv, dim, 64, seed=4)
    mask = torch.ones(heads_q, math.ceil(seq_q / 64), math.ceil(seq_k / 64), dtype=torch.bool)
    out, lse = flex_block_sparse_attention(q, k, v, mask, 64, 0.1, True)
    dense, dense_lse = flash_attn_with_lse_ref(q[None], k[None], v[None], 0.1, True)
    assert_close(out, dense[0], 1e-5)
    assert_close(lse, dense_lse[0], 1e-5)


@pytest.mark.parametrize("case", CASES)
def test_block_lists_give_the_token_mask(case):
    """What the CUDA kernel computes from the lists (full blocks whole, partial blocks through the
    mask_mod) is the contract's token mask, and every kept block that needs no mask is full."""
    seq_q, seq_k, heads_q, _, _, block, causal = case
    _, _, _, mask = make_inputs(seq_q, seq_k, heads_q, 1, 16, block, seed=5)
    n_q, n_k = mask.shape[1:]
    counts, indices, full_counts, full_indices = flex_block_lists(mask, block, seq_q, seq_k, causal)
    assert counts.shape == full_counts.shape == (1, heads_q, n_q) and counts.dtype == torch.int32
    assert indices.shape == full_indices.shape == (1, heads_q, n_q, n_k) and indices.dtype == torch.int32
    partial, full = listed_blocks(counts, indices, n_k), listed_blocks(full_counts, full_indices, n_k)
    assert torch.equal(partial | full, mask) and not (partial & full).any()
    mask_mod = fbs._mask_mod(torch.tensor(seq_k - seq_q), causal)  # the compiled kernel's
    heads, rows, keys = torch.arange(heads_q)[:, None, None], torch.arange(seq_q)[:, None], torch.arange(seq_k)
    in_partial = mask_mod(0, heads, rows, keys) if causal else True
    computed = token_mask(full, block, seq_q, seq_k, False) | (
        token_mask(partial, block, seq_q, seq_k, False) & in_partial)
    assert torch.equal(computed, token_mask(mask, block, seq_q, seq_k, causal))
    # Full iff kept, inside the keys and every (real row, key) pair visible.
    pairs = torch.ones(n_q * block, n_k * block, dtype=torch.bool)
    pairs[:, seq_k:] = False
    pairs[:seq_q, :seq_k] = token_mask(torch.ones(1, n_q, n_k, dtype=torch.bool), block, seq_q, seq_k, causal)[0]
    whole = pairs.view(n_q, block, n_k, block).all(3).all(1)
    assert torch.equal(full, mask & whole)


def test_lists_are_ascending_and_first():
    mask = torch.tensor([[[True, False, True, True], [False, False, False, False]]])
    counts, indices, full_counts, full_indices = flex_block_lists(mask, 32, 64, 128, True)
    # Row positions 64..95 and 96..127: block 0 and 1 are wholly visible to query block 0.
    assert full_counts.tolist() == [[[1, 0]]] and full_indices[0, 0, 0, 0] == 0
    assert counts.tolist() == [[[2, 0]]] and indices[0, 0, 0, :2].tolist() == [2, 3]


def test_strided_inputs_equal_contiguous():
    q, k, v, mask = make_inputs(150, 260, 4, 2, 64, 32, seed=6)
    packed = torch.cat([q, k[:150], v[:150]], dim=1)  # rows of a fused qkv projection: stride 8 * 64
    qs, ks, vs = packed[:, :4], packed[:, 4:6], packed[:, 6:]
    mask = mask[:, :, :5]
    out, lse = flex_block_sparse_attention(qs, ks, vs, mask, 32)
    ref_out, ref_lse = flex_block_sparse_attention(qs.contiguous(), ks.contiguous(), vs.contiguous(), mask, 32)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.filterwarnings("ignore:return_lse is deprecated")
def test_return_lse_keyword_of_older_torch(monkeypatch):
    """Without AuxRequest (PyTorch < 2.9) the LSE comes from ``return_lse=True``."""
    flex = fbs._flex()
    if "return_lse" not in inspect.signature(flex.flex_attention).parameters:
        pytest.skip("this PyTorch's flex_attention has no return_lse")
    q, k, v, mask = make_inputs(100, 300, 4, 1, 64, 32, seed=7)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, 32)
    calls, flex_attention = [], flex.flex_attention

    def spy(*args, **kwargs):
        calls.append(sorted(kwargs))
        return flex_attention(*args, **kwargs)

    monkeypatch.delattr(flex, "AuxRequest")
    monkeypatch.setattr(flex, "flex_attention", spy)
    fbs._attend_fn.cache_clear()
    try:
        out, lse = flex_block_sparse_attention(q, k, v, mask, 32)
    finally:
        fbs._attend_fn.cache_clear()
    assert len(calls) == 1 and "return_lse" in calls[0] and "return_aux" not in calls[0]
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)


def test_empty_and_float64_go_to_reference():
    q, k, v, mask = make_inputs(40, 70, 2, 1, 32, 32, seed=8)
    for args in ((q[:0], k, v, mask[:, :0]), (q, k[:0], v[:0], mask[:, :, :0])):
        out, lse = flex_block_sparse_attention(*args, 32)
        assert (out == 0).all() and torch.isneginf(lse).all() and out.shape == args[0].shape
    out, lse = flex_block_sparse_attention(q.double(), k.double(), v.double(), mask, 32)
    ref_out, ref_lse = block_sparse_attention_ref(q.double(), k.double(), v.double(), mask, 32)
    assert out.dtype == torch.float64 and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_bad_arguments():
    q, k = random_qk(100, 100, 4, 2, 32)
    mask = torch.ones(4, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_size=24"):
        flex_block_sparse_attention(q, k, k, mask, 24)
    with pytest.raises(ValueError, match="mask must be bool"):
        flex_block_sparse_attention(q, k, k, mask[:, :3], 32)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        flex_block_sparse_attention(q, k[:, :1].expand(100, 3, 32), k[:, :1].expand(100, 3, 32), mask, 32)


def test_missing_flex_is_a_runtime_error(monkeypatch):
    q, k, v, mask = make_inputs(40, 70, 2, 1, 32, 32, seed=9)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    monkeypatch.delattr(torch.nn.attention, "flex_attention")
    fbs._flex.cache_clear()
    fbs._attend_fn.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="FlexAttention"):
            flex_block_sparse_attention(q, k, v, mask, 32)
    finally:
        fbs._flex.cache_clear()
        fbs._attend_fn.cache_clear()
