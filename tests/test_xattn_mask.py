"""CPU tests of XAttention's chunked block mask (nanovllm.ops.xattn_mask): chunks of query rows at
any offset select exactly what one whole-sequence selection does (:func:`xattn_block_scores_ref`,
itself checked against float64 math in tests/test_xattn.py), also under Triton's interpreter
(the ``test_interpreted_*`` test, run by ``test_triton_kernels_under_interpreter`` in a child
pytest, see tests/_interpreter.py)."""

import pytest
import torch

from _interpreter import eager_only, interpreted_only, run_interpreted_tests
from _util import random_qk

from nanovllm.ops.xattn_estimate import xattn_block_scores_ref
from nanovllm.ops.xattn_mask import xattn_block_mask
from nanovllm.ops.xattn_select import xattn_select_blocks


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
        (lambda q, k: xattn_block_mask(q, k, 0.9, 8, 64, None, 100), "chunk_size=100"),
        (lambda q, k: xattn_block_mask(q, k, 0.9, 8, 64, None, 128.0), "chunk_size=128.0"),
        (lambda q, k: xattn_block_mask(q, k, 1.5, 8, 64), "threshold=1.5"),
        (lambda q, k: xattn_block_mask(q, k[:10], 0.9, 8, 64), "Sk >= Sq"),
        (lambda q, k: xattn_block_mask(q, k, 0.9, 6, 64), "stride=6"),
    ],
)
def test_bad_arguments(call, message):
    q, k = random_qk(64, 64, 2, 1, 32)
    with pytest.raises(ValueError, match=message):
        call(q, k)


@interpreted_only
def test_interpreted_chunked_mask_equals_reference_selection():
    q, k = random_qk(300, 437, 4, 2, 32, seed=13)
    got = xattn_block_mask(q, k, 0.9, 8, 64, None, 128)
    ref = xattn_select_blocks(xattn_block_scores_ref(q, k, 8, 64), 0.9, True, 64, 300, 437)
    assert torch.equal(got, ref)


# ---------------------------------------------------------------- launcher of the above
@eager_only
def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=1)
