"""No per-length compile storms (issue 14.5): over many prompt lengths each Triton kernel of the
XATTN_BSA prefill, of every layer's prefill and of decode needs a bounded number of compiled
variants, one per length-independent configuration (its specialisation keys, computed on CPU with
Triton's own argument binder; see tests/_compile_variants.py). Before the lengths were taken out of
the keys, 12 lengths in 1.5-2K gave 4-6 variants of each XAttention kernel.
"""
import pytest

from _compile_variants import PROMPT_LENGTHS, WORKLOADS, recorded_keys, varying, xattn_prefill
from _interpreter import require_triton
from nanovllm.ops._triton import row_tile

require_triton()

WIDE_LENGTHS = (257, 300, 511, 1000, 1024, 2047, 3001, 4096, 5555, 8191, 12000, 15000)
"""Lengths across the first :func:`row_tile` octave: up to 128 key blocks of 128 tokens."""
DECODE_LENGTHS = (1, 17, 255, 256, 1000, 1500, 1907, 4096, 8191, 12345)


def _assert_bounded(keys, bounds):
    assert set(keys) == set(bounds), f"launched {sorted(keys)}, expected {sorted(bounds)}"
    for name, found in keys.items():
        assert len(found) <= bounds[name], f"{name}: {len(found)} variants, differing in {varying(name, found)}"


@pytest.mark.parametrize("lengths", [PROMPT_LENGTHS, WIDE_LENGTHS], ids=["1.5-2K", "257-15K"])
@pytest.mark.parametrize("workload", ["xattn_prefill", "layer_steps"])
def test_prefill_variants_bounded(monkeypatch, workload, lengths):
    run, bounds = WORKLOADS[workload]
    with recorded_keys(monkeypatch) as keys:
        for n in lengths:
            run(n, "cpu")
    _assert_bounded(keys, bounds)


def test_xattn_prefill_in_query_chunks_variants_bounded(monkeypatch):
    """Prompts longer than sparse_chunk_size: each chunk's estimation has its own offset and key
    length."""
    run, bounds = WORKLOADS["xattn_prefill"]
    with recorded_keys(monkeypatch) as keys:
        for n in (1500, 1701, 2400, 3333):
            run(n, "cpu", chunk_size=512)
    _assert_bounded(keys, bounds)


def test_decode_variants_bounded(monkeypatch):
    run, bounds = WORKLOADS["decode_steps"]
    with recorded_keys(monkeypatch) as keys:
        for n in DECODE_LENGTHS:
            run(n, "cpu")
    _assert_bounded(keys, bounds)


def test_row_tile_grows_by_octaves():
    lengths = (1, 12, 16, 128, 129, 256, 257, 1024)
    assert [row_tile(n) for n in lengths] == [128, 128, 128, 128, 256, 256, 512, 1024]
    assert [row_tile(n, interpret=True) for n in lengths] == [1, 16, 16, 128, 256, 256, 512, 1024]


def test_pass_a_variants_are_the_two_load_paths(monkeypatch):
    """The one kernel with two variants in GPU-only prefill has exactly two, and they differ only in
    how q and k are loaded (TMA descriptors when both lengths are multiples of the stride, else
    pointers)."""
    name = "xattn_estimate_triton._xattn_partials_kernel"
    with recorded_keys(monkeypatch) as keys:
        for n in PROMPT_LENGTHS:
            xattn_prefill(n, "cpu")
    assert set(varying(name, keys[name])) == {"q_desc", "k_desc", "TMA"}
