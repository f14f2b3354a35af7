"""CPU tests of XAttention estimation over key pieces and query chunks
(nanovllm.ops.xattn_streamed): pieces combined equal the whole-sequence reference
(:func:`xattn_block_scores_ref`, itself checked against float64 math in tests/test_xattn.py),
and the Triton passes equal their references under Triton's interpreter (the
``test_interpreted_*`` tests, run by ``test_triton_kernels_under_interpreter`` in a child pytest,
see tests/_interpreter.py)."""

import pytest
import torch

from _interpreter import eager_only, interpreted_only, run_interpreted_tests
from _util import random_qk

from nanovllm.ops.xattn_estimate import normalise_block_rows, xattn_block_scores_ref
from nanovllm.ops.xattn_select import xattn_select_blocks
from nanovllm.ops.xattn_streamed import (
    merge_row_stats,
    xattn_block_mask,
    xattn_block_sums,
    xattn_block_sums_ref,
    xattn_row_stats,
    xattn_row_stats_ref,
)


def streamed_scores(q, k_pieces, k_chunk, stride, block_size):
    """Offload mode's estimation: earlier pieces non-causal, the chunk (queries' own keys) causal."""
    stats = xattn_row_stats(q, k_chunk, stride, None, True)
    for piece in k_pieces:
        stats = merge_row_stats(*stats, *xattn_row_stats(q, piece, stride, None, False))
    sums = [xattn_block_sums(q, piece, *stats, stride, block_size, None, False) for piece in k_pieces]
    sums.append(xattn_block_sums(q, k_chunk, *stats, stride, block_size, None, True))
    return normalise_block_rows(torch.cat(sums, dim=-1))


# (chunk rows, earlier pieces, piece length, Hq, Hkv, D, stride, block): GQA 3:1 / 1:1, a chunk
# that is not a block (or stride) multiple, no earlier piece.
PIECE_CASES = [
    (300, 3, 256, 6, 2, 64, 8, 128),
    (256, 2, 512, 4, 4, 32, 16, 64),
    (77, 1, 256, 2, 1, 32, 4, 32),
    (200, 0, 256, 4, 2, 32, 8, 64),
]


@pytest.mark.parametrize("case", PIECE_CASES)
def test_pieces_equal_whole_sequence_reference(case):
    seq_q, n_pieces, piece, hq, hkv, dim, stride, block = case
    q, k = random_qk(seq_q, n_pieces * piece + seq_q, hq, hkv, dim, seed=seq_q)
    pieces = list(k[:n_pieces * piece].split(piece)) if n_pieces else []
    got = streamed_scores(q, pieces, k[n_pieces * piece:], stride, block)
    ref = xattn_block_scores_ref(q, k, stride, block)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5


def test_row_stats_merge_in_any_order_and_empty_sides():
    q, k = random_qk(64, 512, 2, 1, 32)
    whole = xattn_row_stats(q, k, 8, None, False)
    parts = [xattn_row_stats(q, part, 8, None, False) for part in k.split(128)]
    merged = parts[3]
    for part in (parts[1], parts[0], parts[2]):
        merged = merge_row_stats(*merged, *part)
    assert torch.allclose(merged[0], whole[0]) and torch.allclose(merged[1], whole[1], rtol=1e-5)
    empty = (torch.full_like(whole[0], float("-inf")), torch.zeros_like(whole[1]))
    assert torch.equal(merge_row_stats(*whole, *empty)[1], whole[1])
    both = merge_row_stats(*empty, *empty)
    assert torch.isneginf(both[0]).all() and (both[1] == 0).all()
    # A causal piece whose keys all lie after the queries: nothing visible, -inf and 0.
    late = xattn_row_stats(q, k[:32], 8, None, True, offset=-64)
    assert torch.isneginf(late[0]).all() and (late[1] == 0).all()


def test_block_sums_with_whole_stats_are_the_unnormalised_scores():
    q, k = random_qk(256, 256, 4, 2, 32, seed=3)
    stats = xattn_row_stats_ref(q, k, 8)
    sums = xattn_block_sums_ref(q, k, *stats, 8, 64)
    # Every strided row sums to 1, so a full query block's row sums to block_size / stride.
    assert torch.allclose(sums.sum(-1), torch.full((4, 4), 8.0), atol=1e-4)
    assert (normalise_block_rows(sums) - xattn_block_scores_ref(q, k, 8, 64)).abs().max() <= 1e-6


@pytest.mark.parametrize("seq_q, seq_k, chunk", [(700, 1003, 128), (700, 1003, 256), (384, 384, 128),
                                                 (300, 301, 256)])
def test_chunked_mask_equals_unchunked_selection(seq_q, seq_k, chunk):
    """Chunks of query rows at an offset (seq_k - seq_q) that is not a stride multiple."""
    q, k = random_qk(seq_q, seq_k, 4, 2, 32, seed=seq_k)
    kept = {}
    for threshold in (0.5, 0.9, 1.0):
        got = xattn_block_mask(q, k, threshold, 8, 128, None, chunk)
        ref = xattn_select_blocks(xattn_block_scores_ref(q, k, 8, 128), threshold, True, 128, seq_q, seq_k)
        assert got.dtype == torch.bool and torch.equal(got, ref), threshold
        kept[threshold] = int(got.sum())
    if seq_k > 1000:
        assert kept[0.5] < kept[1.0], "threshold 0.5 must drop blocks on this input"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q, k: xattn_block_sums(q, k, torch.zeros(2, 3), torch.ones(2, 3), 8, 64), "row_max and row_sumexp"),
        (lambda q, k: xattn_block_mask(q, k, 0.9, 8, 64, None, 100), "chunk_size=100"),
        (lambda q, k: xattn_block_mask(q, k, 0.9, 8, 64, None, 128.0), "chunk_size=128.0"),
        (lambda q, k: xattn_row_stats(q, k, 8, None, True, 1.5), "offset=1.5"),
        (lambda q, k: xattn_block_mask(q, k, 1.5, 8, 64), "threshold=1.5"),
        (lambda q, k: xattn_block_mask(q, k[:10], 0.9, 8, 64), "Sk >= Sq"),
        (lambda q, k: xattn_row_stats(q, k, 6), "stride=6"),
    ],
)
def test_bad_arguments(call, message):
    q, k = random_qk(64, 64, 2, 1, 32)
    with pytest.raises(ValueError, match=message):
        call(q, k)


# ---------------------------------------------------------------- Triton passes (interpreter)
@interpreted_only
@pytest.mark.parametrize("causal, offset", [(True, None), (True, 37), (False, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_row_stats_and_block_sums_match_reference(causal, offset, dtype):
    q, k = random_qk(200, 333, 4, 2, 64, dtype=dtype, seed=11)
    stats = xattn_row_stats(q, k, 8, None, causal, offset)
    ref = xattn_row_stats_ref(q, k, 8, None, causal, offset)
    assert stats[0].dtype == torch.float32 and stats[0].shape == (4, 25)
    assert torch.equal(torch.isneginf(stats[0]), torch.isneginf(ref[0]))
    finite = torch.isfinite(ref[0])
    assert (stats[0][finite] - ref[0][finite]).abs().max() <= 1e-4
    assert torch.allclose(stats[1], ref[1], rtol=1e-4, atol=1e-5)
    sums = xattn_block_sums(q, k, *ref, 8, 64, None, causal, offset)
    assert (sums - xattn_block_sums_ref(q, k, *ref, 8, 64, None, causal, offset)).abs().max() <= 1e-3


@interpreted_only
def test_interpreted_streamed_scores_equal_whole_reference():
    q, k = random_qk(300, 812, 6, 2, 64, seed=12)
    got = streamed_scores(q, list(k[:512].split(256)), k[512:], 8, 128)
    assert (got - xattn_block_scores_ref(q, k, 8, 128)).abs().max() <= 1e-4


@interpreted_only
def test_interpreted_chunked_mask_equals_reference_selection():
    q, k = random_qk(300, 437, 4, 2, 32, seed=13)
    got = xattn_block_mask(q, k, 0.9, 8, 64, None, 128)
    ref = xattn_select_blocks(xattn_block_scores_ref(q, k, 8, 64), 0.9, True, 64, 300, 437)
    assert torch.equal(got, ref)


# ---------------------------------------------------------------- launcher of the above
@eager_only
def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=8)
