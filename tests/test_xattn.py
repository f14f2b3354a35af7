"""CPU tests of XAttention estimation (nanovllm.ops.xattn_estimate, kernels in
nanovllm.ops.xattn_estimate_triton), selection and block-sparse attention
(nanovllm.ops.block_sparse_attention): references against plain float64 math, selection
properties, and the Triton kernels on CPU tensors under Triton's interpreter.

As in tests/test_ops.py, the ``test_interpreted_*`` tests run in a child pytest started by
``test_triton_kernels_under_interpreter`` with TRITON_INTERPRET=1 and NANOVLLM_TRITON_INTERPRET=1;
the parent run skips them. Triton's interpreter computes bfloat16 ``tl.dot`` wrongly (numpy has
no bfloat16), so interpreted tests use float32/float16; bfloat16 is covered in tests/gpu.
"""

import importlib
import math

import pytest
import torch

from _interpreter import eager_only, interpreted_only, run_interpreted_tests
from _util import random_qk

from nanovllm.ops import flash_attn_with_lse_ref
from nanovllm.ops.block_sparse_attention import block_sparse_attention, block_sparse_attention_ref
from nanovllm.ops.xattn_estimate import xattn_block_scores, xattn_block_scores_ref
from nanovllm.ops.xattn_select import block_density, block_layout, xattn_select_blocks, xattn_select_blocks_ref

bsa = importlib.import_module("nanovllm.ops.block_sparse_attention")  # the module (ops exports the function)
xet = importlib.import_module("nanovllm.ops.xattn_estimate_triton")

NEG_INF = float("-inf")

# (Sq, Sk, Hq, Hkv, D, stride, block_size, causal): GQA 4:1 and 1:1, head_dim 64/128, lengths
# that are not block (or stride) multiples, Sq < Sk with an unaligned offset, Sq > Sk.
SCORE_CASES = [
    (256, 256, 4, 1, 64, 8, 32, True),
    (300, 300, 4, 1, 128, 8, 64, True),
    (200, 333, 2, 2, 64, 8, 32, True),
    (131, 70, 4, 1, 64, 4, 32, True),
    (100, 261, 2, 1, 128, 16, 64, False),
]


# ---------------------------------------------------------------- plain float64 math
def naive_block_scores(q, k, stride, block_size, scale, causal):
    """From the full float64 score matrix: antidiagonal sums of each stride x stride tile, causal
    mask per tile, softmax per strided row, sums into blocks, rows normalised."""
    seq_q, heads_q, _ = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    n_qs, n_ks = math.ceil(seq_q / stride), math.ceil(seq_k / stride)
    tile = block_size // stride
    n_q, n_k = math.ceil(seq_q / block_size), math.ceil(seq_k / block_size)
    out = torch.zeros(heads_q, n_q, n_k, dtype=torch.float64)
    for h in range(heads_q):
        full = q[:, h].double() @ k[:, h // (heads_q // heads_kv)].double().T
        padded = torch.zeros(n_qs * stride, n_ks * stride, dtype=torch.float64)
        padded[:seq_q, :seq_k] = full
        tiles = padded.view(n_qs, stride, n_ks, stride)
        anti = sum(tiles[:, stride - 1 - i, :, i] for i in range(stride)) * scale / stride
        for r in range(n_qs):
            cols = [j for j in range(n_ks) if not causal or j * stride <= seq_k - seq_q + r * stride + stride - 1]
            if not cols:
                continue
            row = anti[r, cols]
            probs = torch.exp(row - row.max())
            probs = probs / probs.sum()
            for j, p in zip(cols, probs.tolist()):
                out[h, r // tile, j // tile] += p
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp_min(1e-300), 0.0)


def naive_masked_attention(q, k, v, mask, block_size, scale, causal):
    """float64 loops: (out [Sq, Hq, D], lse [Hq, Sq]) over keys allowed by the block mask."""
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    out = torch.zeros(seq_q, heads_q, dim, dtype=torch.float64)
    lse = torch.full((heads_q, seq_q), NEG_INF, dtype=torch.float64)
    for h in range(heads_q):
        kv = h // (heads_q // heads_kv)
        for i in range(seq_q):
            keys = [j for j in range(seq_k) if mask[h, i // block_size, j // block_size]
                    and (not causal or j <= seq_k - seq_q + i)]
            if not keys:
                continue
            scores = k[keys, kv].double() @ q[i, h].double() * scale
            weights = torch.exp(scores - scores.max())
            lse[h, i] = scores.max() + torch.log(weights.sum())
            out[i, h] = weights @ v[keys, kv].double() / weights.sum()
    return out, lse


def random_mask(heads, seq_q, seq_k, block_size, density, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (heads, math.ceil(seq_q / block_size), math.ceil(seq_k / block_size))
    return torch.rand(shape, generator=gen) < density


def assert_close(actual, expected, tol):
    assert actual.shape == expected.shape
    assert not torch.isnan(actual).any()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = ~torch.isinf(expected)
    err = (actual.double()[finite] - expected.double()[finite]).abs().max() if finite.any() else 0.0
    assert err <= tol, f"max error {float(err):.3e} > {tol}"


# ---------------------------------------------------------------- estimation reference
@pytest.mark.parametrize("case", SCORE_CASES)
def test_block_scores_ref_matches_float64_math(case):
    seq_q, seq_k, hq, hkv, dim, stride, block, causal = case
    q, k = random_qk(seq_q, seq_k, hq, hkv, dim)
    scale = dim**-0.5
    got = xattn_block_scores_ref(q, k, stride, block, scale, causal)
    assert got.dtype == torch.float32 and got.shape == (hq, math.ceil(seq_q / block), math.ceil(seq_k / block))
    assert_close(got, naive_block_scores(q, k, stride, block, scale, causal), 1e-5)


def test_block_scores_rows_sum_to_one_and_hidden_blocks_are_zero():
    q, k = random_qk(300, 420, 4, 2, 64)
    scores = xattn_block_scores_ref(q, k, 8, 64, causal=True)
    visible, _ = block_layout(5, 7, True, 64, 300, 420)
    assert torch.allclose(scores.sum(-1), torch.ones(4, 5), atol=1e-5)
    assert (scores[:, ~visible] == 0).all()
    # Sq > Sk: the first query block sees nothing and scores 0.
    scores = xattn_block_scores_ref(*random_qk(200, 60, 2, 1, 64), 8, 64)
    assert (scores[:, 0] == 0).all() and torch.allclose(scores[:, 2].sum(-1), torch.ones(2))


@eager_only
def test_block_scores_dispatches_to_reference_on_cpu():
    q, k = random_qk(200, 333, 4, 1, 64)
    assert torch.equal(xattn_block_scores(q, k, 8, 32), xattn_block_scores_ref(q, k, 8, 32))


def test_block_scores_float64_and_empty():
    q, k = random_qk(100, 130, 2, 1, 32, dtype=torch.float64)
    got = xattn_block_scores(q, k, 4, 32, 0.2)
    assert got.dtype == torch.float32
    assert_close(got, naive_block_scores(q, k, 4, 32, 0.2, True), 1e-6)
    assert xattn_block_scores(q[:0], k, 4, 32).shape == (2, 0, 5)
    assert xattn_block_scores(q, k[:0], 4, 32).shape == (2, 4, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stride=6), "stride=6"),
        (dict(stride=128), "stride=128"),
        (dict(block_size=4), "block_size=4"),
        (dict(block_size=96), "block_size=96"),
        (dict(stride=8.0), "stride=8.0"),
        (dict(offset=2.7), "offset=2.7"),
        (dict(offset=True), "offset=True"),
        (dict(offset="3"), "offset='3'"),
        (dict(offset=float("nan")), "offset=nan"),
        (dict(stride="8"), "stride='8'"),
        (dict(scale="0.1"), "scale='0.1'"),
        (dict(scale=float("nan")), "scale=nan"),
        (dict(scale=float("inf")), "scale=inf"),
        (dict(scale=-0.125), "scale=-0.125 must be a finite real number > 0"),
        (dict(scale=0), "scale=0 must be a finite real number > 0"),
        (dict(causal="no"), "causal='no'"),
        (dict(causal=None), "causal=None"),
    ],
)
def test_block_scores_bad_arguments(kwargs, message):
    q, k = random_qk(64, 64, 4, 2, 32)
    with pytest.raises(ValueError, match=message):
        xattn_block_scores(q, k, **kwargs)


def test_block_scores_bad_shapes():
    q, k = random_qk(64, 64, 4, 3, 32)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        xattn_block_scores(q, k)
    with pytest.raises(ValueError, match="head_dim=300"):
        xattn_block_scores(torch.zeros(8, 2, 300), torch.zeros(8, 1, 300))
    with pytest.raises(ValueError, match=r"q \[Sq, Hq, D\]"):
        xattn_block_scores(torch.zeros(1, 8, 2, 32), torch.zeros(8, 1, 32))
    with pytest.raises(ValueError, match="q/k must share one of float16/bfloat16/float32/float64"):
        xattn_block_scores(q.half(), k[:, :1])
    with pytest.raises(ValueError, match="got q torch.int32"):
        xattn_block_scores(q.int(), k[:, :1].int())
    with pytest.raises(ValueError, match="k must be on q's device cpu; got meta"):
        xattn_block_scores(q, k[:, :1].to("meta"))
    with pytest.raises(ValueError, match="k must be a torch.Tensor; got list"):
        xattn_block_scores(q, [1, 2])


def test_block_scores_numpy_integers():
    """numpy integers pass the argument checks as ints (never reaching Triton as numpy values)."""
    np = pytest.importorskip("numpy")
    q, k = random_qk(64, 64, 4, 2, 32)
    assert torch.equal(xattn_block_scores(q, k, np.int64(8), np.int64(16)), xattn_block_scores(q, k, 8, 16))


def test_block_scores_offset_default_and_integer_types():
    """``offset=Sk - Sq`` is the default; any int type (0-d int tensor included) is accepted."""
    q, k = random_qk(100, 300, 4, 2, 32, seed=3)
    default = xattn_block_scores(q, k, 8, 32)
    assert torch.equal(xattn_block_scores(q, k, 8, 32, offset=200), default)
    assert torch.equal(xattn_block_scores(q, k, 8, 32, offset=torch.tensor(200)), default)
    assert not torch.equal(xattn_block_scores(q, k, 8, 32, offset=150), default)


# ---------------------------------------------------------------- selection
def _scores(seq_q=512, seq_k=768, heads=4, block=64, seed=1):
    q, k = random_qk(seq_q, seq_k, heads, 2, 64, seed=seed)
    return xattn_block_scores_ref(q, k, 8, block), dict(block_size=block, seq_q=seq_q, seq_k=seq_k)


@pytest.mark.parametrize("causal", [True, False])
def test_threshold_one_keeps_every_visible_block(causal):
    scores, lengths = _scores()
    visible, _ = block_layout(*scores.shape[1:], causal, **lengths)
    mask = xattn_select_blocks(scores, 1.0, causal, **lengths)
    assert mask.dtype == torch.bool and torch.equal(mask, visible.expand_as(mask))
    assert block_density(mask, causal, **lengths) == 1.0


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6, 0.9, 0.95])
def test_selection_reaches_threshold_keeps_sink_and_diagonal(threshold):
    scores, lengths = _scores()
    visible, forced = block_layout(*scores.shape[1:], True, **lengths)
    mask = xattn_select_blocks(scores, threshold, True, **lengths)
    assert not (mask & ~visible).any(), "a causally hidden block was kept"
    assert mask[:, forced].all(), "sink or diagonal block dropped"
    assert mask[:, :, 0].all() and mask[:, torch.arange(8), torch.arange(4, 12)].all()
    kept_sum = torch.where(mask, scores, 0.0).sum(-1)
    assert (kept_sum >= threshold - 1e-6).all()
    # Smallest such set: every block kept beyond the forced ones scores at least as high as every
    # visible block that was dropped.
    extra = mask & ~forced
    lowest_extra = torch.where(extra, scores, float("inf")).amin(-1)
    highest_dropped = torch.where(visible & ~mask, scores, -1.0).amax(-1)
    assert (lowest_extra >= highest_dropped).all()
    # Without the forced blocks the kept prefix is minimal: its sum minus its lowest block is short.
    short = torch.where(extra, scores, 0.0).sum(-1) - torch.where(extra.any(-1), lowest_extra, 0.0)
    assert (short < threshold + 1e-6).all()


def test_selection_is_monotone_in_threshold():
    scores, lengths = _scores(seed=3)
    previous = None
    densities = []
    for threshold in [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]:
        mask = xattn_select_blocks(scores, threshold, True, **lengths)
        if previous is not None:
            assert not (previous & ~mask).any(), f"threshold {threshold} dropped a block"
        previous = mask
        densities.append(block_density(mask, True, **lengths))
    assert densities == sorted(densities) and densities[0] < 0.5 and densities[-1] == 1.0


def test_selection_aligned_defaults_and_ties():
    # Uniform scores (all ties): index order decides, deterministic; lengths default to blocks.
    scores = torch.full((2, 3, 5), 0.2)
    mask = xattn_select_blocks(scores, 0.5, True)
    visible, forced = block_layout(3, 5, True)
    assert torch.equal(visible, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool())
    assert torch.equal(forced[2], torch.tensor([1, 0, 0, 0, 1]).bool())
    assert torch.equal(mask[0, 2], torch.tensor([1, 1, 1, 0, 1]).bool())


def test_selection_and_density_bad_arguments():
    scores = torch.rand(2, 3, 4)
    with pytest.raises(ValueError, match="threshold=1.5"):
        xattn_select_blocks(scores, 1.5, True)
    with pytest.raises(ValueError, match="threshold=-0.1"):
        xattn_select_blocks(scores, -0.1, True)
    with pytest.raises(ValueError, match="seq_q=1000"):
        xattn_select_blocks(scores, 0.9, True, 128, seq_q=1000, seq_k=500)
    with pytest.raises(ValueError, match="causal='no' must be a bool"):
        xattn_select_blocks(scores, 0.9, "no")
    for block_size in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"block_size={block_size!r} must be an int >= 1"):
            xattn_select_blocks(scores, 0.9, True, block_size)
    with pytest.raises(ValueError, match="expected scores .*got list"):
        xattn_select_blocks([[0.5]], 0.9, True)
    for threshold in (None, True, "0.5"):
        with pytest.raises(ValueError, match="must be a real number in 0..1"):
            xattn_select_blocks(scores, threshold, True)
    with pytest.raises(ValueError, match="seq_q=300.5 must be an int >= 0"):
        xattn_select_blocks(torch.rand(2, 3, 4), 0.9, True, 128, seq_q=300.5, seq_k=500)
    with pytest.raises(ValueError, match="causal='no'"):
        block_layout(3, 4, "no")
    with pytest.raises(ValueError, match=r"mask \[Hq, nQ, nK\]"):
        block_density(torch.ones(3, 4, dtype=torch.bool))


@interpreted_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k, block", [(512, 768, 64), (40, 2000, 16), (700, 300, 64)])
def test_interpreted_select_kernel_matches_reference(causal, seq_q, seq_k, block):
    """The selection kernel (int64 keys, bitonic sort, float64 prefix sum) keeps exactly the
    reference's blocks: real scores at several thresholds, nK not a power of two, Sq > Sk."""
    q, k = random_qk(seq_q, seq_k, 4, 2, 32, seed=5)
    scores = xattn_block_scores_ref(q, k, 8, block, causal=causal)
    lengths = dict(block_size=block, seq_q=seq_q, seq_k=seq_k)
    for threshold in (0.0, 0.5, 0.9, 0.999):
        got = xattn_select_blocks(scores, threshold, causal, **lengths)
        assert got.dtype == torch.bool and got.shape == scores.shape
        assert torch.equal(got, xattn_select_blocks_ref(scores, threshold, causal, **lengths)), threshold


@interpreted_only
def test_interpreted_select_kernel_ties_and_zeros():
    """Ties keep index order; zero rows keep only the forced blocks; a strided (transposed) score
    tensor is read correctly."""
    scores = torch.full((2, 3, 5), 0.2)
    scores[1, 1] = 0.0
    assert torch.equal(xattn_select_blocks(scores, 0.5, True), xattn_select_blocks_ref(scores, 0.5, True))
    rand = torch.rand(5, 3, 2).permute(2, 1, 0)  # [2, 3, 5], last dim strided
    rand = rand / rand.sum(-1, keepdim=True)
    assert torch.equal(xattn_select_blocks(rand, 0.7, False), xattn_select_blocks_ref(rand, 0.7, False))
    # numpy and 0-d torch integer lengths reach the kernel as ints.
    np = pytest.importorskip("numpy")
    lengths = dict(block_size=np.int64(16), seq_q=np.int64(40), seq_k=torch.tensor(70))
    block = torch.rand(2, 3, 5)
    assert torch.equal(xattn_select_blocks(block, 0.5, True, **lengths),
                       xattn_select_blocks_ref(block, 0.5, True, 16, 40, 70))
    # -0.0 and negative scores (outside the contract, but every entry must still be written as
    # the reference decides): the kernel orders float bits, sign included.
    signed = torch.tensor([[[-0.0, 0.6, -0.0, 0.4, -0.5, -0.25, 0.0]]])
    for threshold in (0.0, 0.5, 1.0 - 1e-9):
        for causal in (True, False):
            assert torch.equal(xattn_select_blocks(signed, threshold, causal),
                               xattn_select_blocks_ref(signed, threshold, causal)), (threshold, causal)


def test_block_density_counts_visible_blocks_only():
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[:, torch.arange(4), torch.arange(4)] = True
    assert block_density(mask, True) == pytest.approx(4 / 10)
    assert block_density(mask, False) == pytest.approx(4 / 16)
    assert block_density(torch.ones(2, 4, 4, dtype=torch.bool), True) == 1.0


# ---------------------------------------------------------------- block-sparse attention reference
@pytest.mark.parametrize("heads_q, heads_kv, dim", [(4, 1, 64), (2, 2, 128)])
@pytest.mark.parametrize("seq_q, seq_k", [(200, 200), (150, 333)])
def test_bsa_ref_all_blocks_equals_dense_causal(heads_q, heads_kv, dim, seq_q, seq_k):
    q, k = random_qk(seq_q, seq_k, heads_q, heads_kv, dim)
    v = torch.randn(seq_k, heads_kv, dim)
    mask = torch.ones(heads_q, math.ceil(seq_q / 64), math.ceil(seq_k / 64), dtype=torch.bool)
    out, lse = block_sparse_attention_ref(q, k, v, mask, 64, dim**-0.5, True)
    dense, dense_lse = flash_attn_with_lse_ref(q[None], k[None], v[None], dim**-0.5, True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (heads_q, seq_q)
    assert_close(out, dense[0], 1e-5)
    assert_close(lse, dense_lse[0], 1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_bsa_ref_random_mask_matches_float64_math(causal):
    q, k = random_qk(90, 130, 4, 1, 64, seed=5)
    v = torch.randn(130, 1, 64)
    mask = random_mask(4, 90, 130, 32, 0.4, seed=5)
    mask[0, 0] = False  # a query block that sees no key at all
    out, lse = block_sparse_attention(q, k, v, mask, 32, 0.1, causal)
    ref_out, ref_lse = naive_masked_attention(q, k, v, mask, 32, 0.1, causal)
    assert_close(out, ref_out.float(), 1e-5)
    assert_close(lse, ref_lse.float(), 1e-5)
    assert (out[:32, 0] == 0).all() and torch.isneginf(lse[0, :32]).all()


def test_bsa_bad_arguments():
    q, k = random_qk(100, 100, 4, 2, 32)
    mask = torch.ones(4, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_size=24"):
        block_sparse_attention(q, k, k, mask, 24)
    with pytest.raises(ValueError, match=r"mask must be bool"):
        block_sparse_attention(q, k, k, mask[:, :3], 32)
    with pytest.raises(ValueError, match=r"mask must be bool"):
        block_sparse_attention(q, k, k, mask.int(), 32)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        block_sparse_attention(q, k[:, :1].expand(100, 3, 32), k[:, :1].expand(100, 3, 32), mask, 32)
    with pytest.raises(ValueError, match="got q torch.float16, k torch.float32, v torch.float32"):
        block_sparse_attention(q.half(), k, k, mask, 32)
    with pytest.raises(ValueError, match="got q torch.int32"):
        block_sparse_attention(q.int(), k.int(), k.int(), mask, 32)
    with pytest.raises(ValueError, match="mask must be on q's device cpu; got meta"):
        block_sparse_attention(q, k, k, mask.to("meta"), 32)
    with pytest.raises(ValueError, match="block_size=32.0"):
        block_sparse_attention(q, k, k, mask, 32.0)
    with pytest.raises(ValueError, match="block_size='32'"):
        block_sparse_attention(q, k, k, mask, "32")
    with pytest.raises(ValueError, match="v must be on q's device cpu; got meta"):
        block_sparse_attention(q, k, k.to("meta"), mask, 32)
    with pytest.raises(ValueError, match="mask must be a torch.Tensor; got NoneType"):
        block_sparse_attention(q, k, k, None, 32)
    for scale in ("0.1", float("nan"), float("inf"), 1j, -4.0, 0.0):
        with pytest.raises(ValueError, match="scale=.* must be a finite real number > 0"):
            block_sparse_attention(q, k, k, mask, 32, scale)
    for causal in ("no", None, 2):
        with pytest.raises(ValueError, match="causal=.* must be a bool"):
            block_sparse_attention(q, k, k, mask, 32, None, causal)


# ---------------------------------------------------------------- Triton kernels (interpreter)
@pytest.fixture
def nan_filled_empty(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled float tensors, so a kernel that reads a
    buffer entry no kernel wrote shows up as NaN (other dtypes are left as they come)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_filled(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: nan_filled(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: nan_filled(empty_like(*args, **kwargs)))


@interpreted_only
@pytest.mark.parametrize("case", SCORE_CASES + [(256, 256, 2, 1, 64, 16, 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_block_scores_match_reference(case, dtype, nan_filled_empty):
    seq_q, seq_k, hq, hkv, dim, stride, block, causal = case
    q, k = random_qk(seq_q, seq_k, hq, hkv, dim, dtype=dtype, seed=7)
    got = xattn_block_scores(q, k, stride, block, dim**-0.5, causal)
    ref = xattn_block_scores_ref(q, k, stride, block, dim**-0.5, causal)
    assert got.dtype == torch.float32
    assert_close(got, ref, 1e-3)
    lengths = dict(block_size=block, seq_q=seq_q, seq_k=seq_k)
    if dtype == torch.float32:
        for threshold in (0.5, 0.9, 0.95):
            assert torch.equal(
                xattn_select_blocks(got, threshold, causal, **lengths),
                xattn_select_blocks(ref, threshold, causal, **lengths),
            )


def rising_qk(seq_q, seq_k, heads_q, heads_kv, dim, seed=11):
    """q and k whose strided scores grow with the key position (k gains ``8 * pos / Sk`` along a
    direction every query leans towards): each row's max sits in its last visible key tile while
    the earlier tiles keep a sizeable share of the probability, so a wrong rescale shows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_q, heads_q, dim, generator=gen)
    k = torch.randn(seq_k, heads_kv, dim, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
    rise = 8.0 * torch.arange(seq_k) / seq_k
    return q + 3.0 * u, k + rise[:, None, None] * u


@interpreted_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "seq_q, seq_k, stride, block",
    # 3 key tiles of 128 strided keys per row (TILE 8); 3 tiles of 256 (TILE 256: one query
    # block spans 3 programs of 64 rows); 3 tiles of 128 with one strided key per block (TILE 1).
    [(301, 1103, 4, 32), (301, 1103, 2, 512), (301, 4500, 16, 16)],
)
def test_interpreted_block_scores_rescale_across_key_tiles(causal, seq_q, seq_k, stride, block,
                                                          nan_filled_empty):
    q, k = rising_qk(seq_q, seq_k, 4, 2, 80)
    got = xattn_block_scores(q, k, stride, block, 80**-0.5, causal)
    ref = xattn_block_scores_ref(q, k, stride, block, 80**-0.5, causal)
    assert_close(got, ref, 1e-5)
    visible, _ = block_layout(*got.shape[1:], causal, block, seq_q, seq_k)
    assert (got[:, ~visible] == 0).all()
    assert torch.allclose(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5)


@interpreted_only
def test_interpreted_block_scores_strided_rows():
    qkv = torch.randn(300, 12, 64)
    q, k = qkv[:, :8], qkv[:, 8:10]
    assert_close(xattn_block_scores(q, k, 8, 64), xattn_block_scores_ref(q.contiguous(), k.contiguous(), 8, 64), 1e-4)


@interpreted_only
@pytest.mark.parametrize("seq_q, seq_k, causal", [(256, 256, True), (128, 384, True), (200, 320, False)])
def test_interpreted_block_scores_tma_and_pointer_paths(monkeypatch, seq_q, seq_k, causal):
    """Lengths that are multiples of the stride load q and k through TMA descriptors over the
    strided view (rows of a fused qkv projection here); the pointer path gives the same scores,
    and both equal the reference."""
    qkv = torch.randn(max(seq_q, seq_k), 12, 64)
    q, k = qkv[-seq_q:, :8], qkv[:seq_k, 8:10]
    config = xet._partials_config(q, 8, 64, causal)
    assert all(d is not None for d in xet._strided_descriptors(q, k, 8, config))
    tma = xattn_block_scores(q, k, 8, 64, causal=causal)
    monkeypatch.setattr(xet, "_strided_descriptors", lambda *args: (None, None))
    pointers = xattn_block_scores(q, k, 8, 64, causal=causal)
    assert_close(tma, pointers, 1e-6)
    assert_close(tma, xattn_block_scores_ref(q.contiguous(), k.contiguous(), 8, 64, causal=causal), 1e-4)


@interpreted_only
def test_interpreted_head_major_and_numpy_arguments():
    """Head-major q/k (heads not adjacent in a row) take the pointer path and equal the
    reference; numpy integers reach the kernels as ints."""
    np = pytest.importorskip("numpy")
    q = torch.randn(4, 256, 64).transpose(0, 1)
    k = torch.randn(2, 256, 64).transpose(0, 1)
    assert xet._strided_descriptors(q, k, 8, xet._partials_config(q, 8, 64, True)) == (None, None)
    ref = xattn_block_scores_ref(q.contiguous(), k.contiguous(), 8, 64)
    assert_close(xattn_block_scores(q, k, np.int64(8), np.int64(64)), ref, 1e-4)
    v = torch.randn(256, 2, 64)
    mask = random_mask(4, 256, 256, 64, 0.5, seed=12)
    out, _ = block_sparse_attention(q, k, v, mask, np.int64(64))
    assert_close(out, block_sparse_attention_ref(q, k, v, mask, 64)[0], 1e-4)


@interpreted_only
def test_interpreted_bsa_nan_propagates():
    """A NaN key gives NaN in out and lse for the rows that attend to it, as in the reference,
    never lse -inf (which an LSE merge would drop as "no key")."""
    q, k = random_qk(128, 128, 2, 1, 64, seed=13)
    v = torch.randn(128, 1, 64)
    k[50, 0, 0] = float("nan")
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    out, lse = block_sparse_attention(q, k, v, mask, 64)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, 64)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)) and torch.isnan(lse[:, 50:]).all()
    assert not torch.isneginf(lse).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out)) and not torch.isnan(out[:50]).any()


def test_strided_descriptor_rules():
    """TMA only where the strided view stays inside the tensors and a bulk copy is valid."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    q, k = torch.randn(256, 4, 64), torch.randn(256, 2, 64)
    config = xet._partials_config(q, 8, 128, True)
    assert all(d is not None for d in xet._strided_descriptors(q, k, 8, config))
    assert xet._strided_descriptors(q[:250], k, 8, config) == (None, None)  # Sq not a multiple of S
    assert xet._strided_descriptors(q, k[:251], 8, config) == (None, None)
    odd = torch.randn(256, 4, 80)
    assert xet._strided_descriptors(odd, odd[:, :2], 8, xet._partials_config(odd, 8, 128, True)) == (None, None)
    head_major = torch.randn(2, 256, 64).transpose(0, 1)
    assert xet._strided_descriptors(q, head_major, 8, config) == (None, None)
    assert xet._strided_descriptors(q, torch.randn(1, 2, 64).expand(256, 2, 64), 8, config) == (None, None)


@interpreted_only
@pytest.mark.parametrize("heads_q, heads_kv, dim", [(4, 1, 64), (2, 2, 128)])
@pytest.mark.parametrize("seq_q, seq_k", [(200, 200), (150, 333), (70, 40)])
def test_interpreted_bsa_all_blocks_equals_dense(heads_q, heads_kv, dim, seq_q, seq_k):
    q, k = random_qk(seq_q, seq_k, heads_q, heads_kv, dim, seed=2)
    v = torch.randn(seq_k, heads_kv, dim)
    mask = torch.ones(heads_q, math.ceil(seq_q / 32), math.ceil(seq_k / 32), dtype=torch.bool)
    out, lse = block_sparse_attention(q, k, v, mask, 32, dim**-0.5, True)
    dense, dense_lse = flash_attn_with_lse_ref(q[None], k[None], v[None], dim**-0.5, True)
    # float32 in different summation orders: the heavy keys give scores of ~30, whose rounding
    # (~2e-6) exp() turns into ~1e-4 relative differences of the weights.
    assert_close(out, dense[0], 1e-4)
    assert_close(lse, dense_lse[0], 1e-5)


@interpreted_only
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("causal", [True, False])
def test_interpreted_bsa_random_mask_matches_reference(dtype, tol, causal):
    q, k = random_qk(300, 450, 4, 1, 64, dtype=dtype, seed=4)
    v = torch.randn(450, 1, 64).to(dtype)
    mask = random_mask(4, 300, 450, 64, 0.35, seed=4)
    mask[1, 0] = False
    out, lse = block_sparse_attention(q, k, v, mask, 64, 0.125, causal)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, 64, 0.125, causal)
    assert out.dtype == dtype
    assert_close(out.float(), ref_out.float(), tol)
    assert_close(lse, ref_lse, 1e-4)


@interpreted_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dim, seq_q, seq_k, block", [(80, 200, 333, 128), (64, 256, 256, 128), (64, 300, 700, 256)])
def test_interpreted_bsa_full_and_partial_tiles(causal, dim, seq_q, seq_k, block):
    """Full blocks (below the query block's diagonal, inside the keys) run without masks, the
    others with them; head_dim 80 pads to 128 lanes (masked d) and takes 64-key tiles, so a
    128-key block is two tiles, as is a 256-key block with 128-key tiles; Sk - Sq = 133 puts the
    diagonal inside a tile."""
    heads_q, heads_kv = 2, 1
    q, k = random_qk(seq_q, seq_k, heads_q, heads_kv, dim, seed=9)
    v = torch.randn(seq_k, heads_kv, dim)
    mask = random_mask(heads_q, seq_q, seq_k, block, 0.7, seed=9)
    out, lse = block_sparse_attention(q, k, v, mask, block, dim**-0.5, causal)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, block, dim**-0.5, causal)
    assert_close(out, ref_out, 1e-4)
    assert_close(lse, ref_lse, 1e-5)


@interpreted_only
@pytest.mark.parametrize("seq_q, seq_k, heads_q, heads_kv, dim, block, causal", [
    (96, 64, 2, 1, 64, 32, True), (96, 64, 2, 1, 64, 32, False), (20, 90, 4, 1, 64, 32, True),
    (20, 30, 2, 2, 64, 32, False), (130, 333, 4, 1, 128, 32, False)])
def test_interpreted_bsa_edge_shapes(seq_q, seq_k, heads_q, heads_kv, dim, block, causal):
    """Sq > Sk (causal: the early rows see no key; not causal: every row sees the keys), one query
    block, one key block, a query block that keeps nothing."""
    q, k = random_qk(seq_q, seq_k, heads_q, heads_kv, dim, seed=10)
    v = torch.randn(seq_k, heads_kv, dim)
    mask = random_mask(heads_q, seq_q, seq_k, block, 0.6, seed=10)
    mask[-1, 0] = False
    out, lse = block_sparse_attention(q, k, v, mask, block, dim**-0.5, causal)
    ref_out, ref_lse = block_sparse_attention_ref(q, k, v, mask, block, dim**-0.5, causal)
    assert_close(out, ref_out, 1e-4)
    assert_close(lse, ref_lse, 1e-5)
    assert (out[:min(block, seq_q), -1] == 0).all() and torch.isneginf(lse[-1, :min(block, seq_q)]).all()


@interpreted_only
def test_interpreted_bsa_strided_inputs_equal_contiguous():
    """Rows of a fused qkv projection (TMA descriptors over strided rows) and heads that are not
    adjacent in a row (pointer loads) give the contiguous inputs' results."""
    qkv = torch.randn(150, 8, 64)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    mask = random_mask(4, 150, 150, 32, 0.5, seed=11)
    ref_out, ref_lse = block_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, 32)
    wide = torch.randn(150, 2, 128)
    apart_k, apart_v = wide[:, :, :64], wide[:, :, 64:]
    apart_k.copy_(k), apart_v.copy_(v)
    assert bsa._kv_descriptors(k, v, 32)[0] is not None and bsa._kv_descriptors(apart_k, apart_v, 32)[0] is None
    for keys, values in ((k, v), (apart_k, apart_v)):
        out, lse = block_sparse_attention(q, keys, values, mask, 32)
        assert_close(out, ref_out, 1e-6)
        assert_close(lse, ref_lse, 1e-6)


def test_bsa_descriptor_rules():
    """TMA descriptors only where a bulk copy is valid: power-of-two head_dim of >= 16 bytes, heads
    adjacent in a row, 16-byte aligned base and row stride."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    k = torch.randn(100, 2, 64)
    assert all(d is not None for d in bsa._kv_descriptors(k, k, 64))
    assert bsa._kv_descriptors(torch.randn(100, 2, 80), torch.randn(100, 2, 80), 64) == (None, None)
    assert bsa._kv_descriptors(torch.randn(100, 2, 2), torch.randn(100, 2, 2), 64) == (None, None)
    odd = torch.randn(100 * 129 + 1)[1:].view(100, 129)[:, :128].view(100, 2, 64)  # 4-byte offset, stride 129
    assert bsa._kv_descriptors(odd, odd, 64) == (None, None)
    assert bsa._kv_descriptors(k[:, :, :32], k[:, :, :32], 64) == (None, None)
    expanded = torch.randn(1, 2, 64).expand(100, 2, 64)
    assert bsa._kv_descriptors(expanded, expanded, 64) == (None, None)


@interpreted_only
def test_interpreted_bsa_rows_without_keys():
    # Causal with Sq > Sk: the first 60 rows see no key.
    q, k = random_qk(100, 40, 2, 1, 64, seed=6)
    mask = torch.ones(2, 4, 2, dtype=torch.bool)
    out, lse = block_sparse_attention(q, k, k, mask, 32, 0.125, True)
    assert (out[:60] == 0).all() and torch.isneginf(lse[:, :60]).all()
    assert_close(lse, block_sparse_attention_ref(q, k, k, mask, 32, 0.125, True)[1], 1e-5)


@interpreted_only
def test_interpreted_xattn_pipeline_end_to_end():
    q, k = random_qk(384, 384, 4, 1, 64, seed=8)
    v = torch.randn(384, 1, 64)
    mask = xattn_select_blocks(xattn_block_scores(q, k, 8, 64), 0.9, True, 64)
    out, _ = block_sparse_attention(q, k, v, mask, 64)
    ref_out, _ = naive_masked_attention(q, k, v, mask, 64, 64**-0.5, True)
    assert_close(out, ref_out.float(), 1e-5)


# ---------------------------------------------------------------- launcher of the above
@eager_only
def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=54)
