"""CPU tests of the block lists that the block-sparse attention kernel walks
(nanovllm.ops.block_lists): the attention kernel attends the *full* blocks with no mask and the
*partial* ones with the causal and key-end masks, so the token mask it computes from the lists
must be the contract's (checked on the torch reference); the lists kernel must give the
reference's lists (under Triton's interpreter here, on the GPU in tests/gpu/test_xattn_gpu.py).
The attention kernel itself is compared with its reference in tests/test_xattn.py.
"""

import math

import pytest
import torch
from _interpreter import interpreted_only, run_interpreted_tests

from nanovllm.ops.block_lists import full_layout, kept_block_lists, kept_block_lists_ref

# (Sq, Sk, Hq, block_size, causal): lengths that are not block multiples, Sq < Sk with an
# unaligned offset, Sq > Sk (early rows see no key), one query block and one key block.
CASES = [
    (100, 300, 4, 32, True),
    (200, 200, 2, 64, True),
    (130, 333, 4, 32, False),
    (96, 64, 2, 32, True),
    (20, 90, 4, 32, True),
    (20, 30, 2, 32, False),
]


def token_mask(mask, block_size, seq_q, seq_k, causal):
    """bool [Hq, Sq, Sk]: what query row i may see (the contract)."""
    tokens = mask.repeat_interleave(block_size, 1)[:, :seq_q].repeat_interleave(block_size, 2)[:, :, :seq_k]
    if causal:
        rows = torch.arange(seq_q)[:, None] + seq_k - seq_q
        tokens = tokens & (torch.arange(seq_k)[None, :] <= rows)
    return tokens


def listed_blocks(count, index, n_k):
    """bool [Hq, nQ, nK] of the blocks a (count [Hq, nQ], index [Hq, nQ, nK]) pair lists."""
    valid = torch.arange(index.shape[-1]) < count[..., None]
    dense = torch.zeros(*index.shape[:-1], n_k + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(valid, index.long(), n_k), True)
    return dense[..., :n_k]


@pytest.mark.parametrize("case", CASES)
def test_lists_give_the_token_mask(case):
    """Full blocks taken whole and partial blocks through the kernel's masks give the contract's
    token mask, and every kept block that needs no mask is full."""
    seq_q, seq_k, heads_q, block, causal = case
    n_q, n_k = math.ceil(seq_q / block), math.ceil(seq_k / block)
    mask = torch.rand((heads_q, n_q, n_k), generator=torch.Generator().manual_seed(5)) < 0.5
    full_counts, full_indices, counts, indices = kept_block_lists_ref(mask, block, seq_q, seq_k, causal)
    full = listed_blocks(full_counts, full_indices, n_k)
    assert counts.shape == (heads_q, n_q) and counts.dtype == torch.int32
    assert indices.shape == (heads_q, n_q, n_k) and indices.dtype == torch.int32
    partial = listed_blocks(counts, indices, n_k)
    assert torch.equal(partial | full, mask) and not (partial & full).any()
    assert torch.equal(full, mask & full_layout(n_q, n_k, block, seq_q, seq_k, causal, mask.device))
    computed = token_mask(full, block, seq_q, seq_k, False) | token_mask(partial, block, seq_q, seq_k, causal)
    assert torch.equal(computed, token_mask(mask, block, seq_q, seq_k, causal))
    # Full iff kept, inside the keys and every (real row, key) pair visible.
    pairs = torch.ones(n_q * block, n_k * block, dtype=torch.bool)
    pairs[:, seq_k:] = False
    pairs[:seq_q, :seq_k] = token_mask(torch.ones(1, n_q, n_k, dtype=torch.bool), block, seq_q, seq_k, causal)[0]
    whole = pairs.view(n_q, block, n_k, block).all(3).all(1)
    assert torch.equal(full, mask & whole)


def test_lists_are_ascending_and_first():
    mask = torch.tensor([[[True, False, True, True], [False, False, False, False]]])
    full_counts, full_indices, counts, indices = kept_block_lists_ref(mask, 32, 64, 128, True)
    # Row positions 64..95 and 96..127: blocks 0 and 1 are wholly visible to query block 0.
    assert full_counts.tolist() == [[1, 0]] and full_indices[0, 0, 0] == 0
    assert counts.tolist() == [[2, 0]] and indices[0, 0, :2].tolist() == [2, 3]


def _assert_same_lists(got, want):
    """Equal counts, and equal indices wherever a count says they are listed."""
    for (count, index), (ref_count, ref_index) in zip((got[:2], got[2:]), (want[:2], want[2:])):
        assert torch.equal(count, ref_count)
        listed = torch.arange(index.shape[-1]) < count[..., None]
        assert torch.equal(index[listed], ref_index[listed])


@interpreted_only
@pytest.mark.parametrize("case", CASES + [(1000, 1000, 3, 16, True), (64, 4096, 2, 16, True)])
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_interpreted_kernel_lists_match_reference(case, density):
    """The lists kernel (one program per query block, prefix sums) gives the reference's lists,
    for empty, random and full masks, nK not a power of two and nK = 256."""
    seq_q, seq_k, heads_q, block, causal = case
    n_q, n_k = math.ceil(seq_q / block), math.ceil(seq_k / block)
    mask = torch.rand((heads_q, n_q, n_k), generator=torch.Generator().manual_seed(7)) < density
    _assert_same_lists(kept_block_lists(mask, block, seq_q, seq_k, causal),
                       kept_block_lists_ref(mask, block, seq_q, seq_k, causal))


def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=24)


@pytest.mark.parametrize("lists", [kept_block_lists, kept_block_lists_ref])
def test_bad_arguments_raise(lists):
    """Bad input names the argument and the limit (a non-bool mask read as bytes gave wrong lists)."""
    good = torch.ones(2, 3, 5, dtype=torch.bool)
    cases = [
        (dict(mask=good.long()), r"mask must be a bool tensor \[Hq, nQ, nK\]; got torch.int64"),
        (dict(mask=good.float()), "mask must be a bool tensor"),
        (dict(mask=good[0]), r"got torch.bool \(3, 5\)"),
        (dict(mask=None), "got NoneType"),
        (dict(block_size=8), "block_size=8 must be a power of two in 16..1024"),
        (dict(block_size=24), "block_size=24"),
        (dict(seq_q=-1), "seq_q=-1 must be a non-negative int"),
        (dict(seq_k=70.0), "seq_k=70.0 must be a non-negative int"),
        (dict(seq_q=80), r"must have nQ, nK = ceil\(seq_q/16\), ceil\(seq_k/16\) = \(5, 5\)"),
        (dict(causal="yes"), "causal='yes' must be a bool"),
    ]
    for change, message in cases:
        args = dict(mask=good, block_size=16, seq_q=40, seq_k=70, causal=True) | change
        with pytest.raises(ValueError, match=message):
            lists(**args)


def test_numpy_integers_are_accepted():
    """numpy integer lengths and block sizes give the lists of the Python ints."""
    import numpy as np

    mask = torch.rand((2, 3, 5), generator=torch.Generator().manual_seed(3)) < 0.6
    got = kept_block_lists(mask, np.int64(16), np.int64(40), np.int32(70), True)
    _assert_same_lists(got, kept_block_lists_ref(mask, 16, 40, 70, True))
