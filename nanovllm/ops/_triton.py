"""What the kernel modules of ``nanovllm.ops`` share: constants, argument checks, tile widths and
the Triton functions several kernels call. Whether Triton is installed and which path a tensor
takes: :mod:`nanovllm.ops.backend`.

Compiled variants. Triton compiles a kernel once per specialisation key: its constexpr values and,
for every int argument not listed in ``do_not_specialize``, whether it is 1 and whether it is a
multiple of 16 (tensors: whether their address is 16-byte aligned). Every kernel here therefore lists
in ``do_not_specialize`` the ints that follow the sequence lengths (lengths, block counts, offsets and
the strides of buffers sized by them), and sizes its constexpr tiles from the model and the
configuration, or from :func:`row_tile` (one width up to 128 blocks), never from a length directly
(under the interpreter nothing is compiled and tiles stay small): a new prompt length reuses a
compiled kernel (docs/benchmarks.md, 'No per-length compile storms').
Strides fixed by the model (head_dim, heads, cache rows) stay specialised: their alignment is what
lets Triton vectorise the loads. ``tests/test_compile_variants.py`` counts the keys.
"""

import math
import operator
from numbers import Real

import torch

from nanovllm.utils.dtypes import FP8_DTYPES

from .backend import interpreted, tl, triton

LOG2E = 1.4426950408889634
"""log2(e): kernels run softmax in base 2 (``exp2``), so scales are multiplied by it."""
MIN_DOT_ROWS = 16
"""tl.dot needs at least 16 rows: a GQA group of q heads is padded to it."""

MAX_HEAD_DIM = 256
"""Largest head_dim any op accepts (Triton tiles pad head_dim to a power of two <= this)."""


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless 1 <= head_dim <= MAX_HEAD_DIM."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is outside the supported range 1..{MAX_HEAD_DIM}")


def check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError unless num_q_heads is a positive multiple of num_kv_heads."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads} (>= 1)"
        )


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_dtype(**tensors: torch.Tensor) -> None:
    """ValueError unless the named tensors share one dtype among :data:`FLOAT_DTYPES`."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    if first not in FLOAT_DTYPES or any(d != first for d in dtypes.values()):
        got = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise ValueError(f"{'/'.join(dtypes)} must share one of float16/bfloat16/float32/float64; got {got}")


def check_offset(offset) -> int | None:
    """``offset`` as an int (None stays None); ValueError for a bool, float or other non-integer."""
    if offset is None:
        return None
    try:
        if isinstance(offset, bool):
            raise TypeError
        return operator.index(offset)
    except TypeError:
        raise ValueError(f"offset={offset!r} must be an int (the key position of query row 0, any sign)") from None


def check_scale(scale) -> float | None:
    """``scale`` as a float (None stays None); ValueError unless it is a finite real number > 0
    (a string, bool, complex, NaN, inf, zero or negative number is refused: the kernels take the
    row max of the raw scores as the max of the scaled ones)."""
    if scale is None:
        return None
    if isinstance(scale, (bool, str)) or not isinstance(scale, Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r} must be a finite real number > 0 (the softmax scale)")
    return float(scale)


def check_causal(causal) -> bool:
    """``causal`` as a bool; ValueError for anything but True/False (or 1/0)."""
    if causal not in (True, False):
        raise ValueError(f"causal={causal!r} must be a bool")
    return bool(causal)


def check_same_device(**tensors: torch.Tensor) -> None:
    """ValueError unless the named tensors (the first is the reference) are torch tensors on one
    device."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{name} must be on {first}'s device {ref.device}; got {t.device}")


def row_group_descriptor(t: torch.Tensor, group: int, block_rows: int):
    """A TMA tensor descriptor of ``t [S, H, D]`` viewed as ``[S / group, (group - 1) * row stride
    + H * D]``: view row r holds token rows ``r * group ..``, and token row ``r * group + i`` of
    head h starts at column ``i * row stride + h * D``; tiles of ``[block_rows, D]``, rows past the
    end read as zero. None where the view or the bulk-copy rules rule it out: S not a multiple of
    ``group`` (the last view row would run past the tensor), heads not adjacent in a row, a row
    stride of 0, head_dim not a power of two of >= 16 bytes, a base address or view row stride not
    a multiple of 16 bytes; also where Triton has no host-side descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    seq, heads, dim = t.shape
    size, row = t.element_size(), t.stride(0)
    if (seq % group or t.stride(1) != dim or row <= 0 or block_dim(dim) != dim or dim * size < 16
            or t.data_ptr() % 16 or group * row * size % 16):
        return None
    return TensorDescriptor(t, [seq // group, (group - 1) * row + heads * dim], [group * row, 1], [block_rows, dim])


def both_or_neither(first, second) -> tuple:
    """``(first, second)``, or ``(None, None)`` when either descriptor is None: a kernel loads its
    two TMA operands through descriptors together or not at all."""
    return (None, None) if first is None or second is None else (first, second)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


MIN_ROW_TILE = 128
"""Smallest compiled :func:`row_tile`."""


def row_tile(n: int, interpret: bool = False) -> int:
    """Tile width of a kernel that holds a whole row of ``n`` key blocks (a sort, a prefix sum):
    the next power of two >= n, for a compiled kernel at least :data:`MIN_ROW_TILE`, so one
    compiled variant serves every row of up to 128 blocks (16K tokens at 128-token blocks) and one
    more each octave above. Under the interpreter (``interpret``) the bare power of two, since
    nothing is compiled there and wide tiles only slow the CPU tests (docs/ops.md, 'Conventions')."""
    return next_pow2(n) if interpret else max(MIN_ROW_TILE, next_pow2(n))


def block_dim(head_dim: int) -> int:
    """Triton tile width for head_dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(head_dim))


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """FlashAttention-2's online-softmax update (Dao, 2023) for one tile of keys: ``s`` the
    tile's scaled scores in log2 units ``[M, N]`` (-inf where hidden), ``v`` its values
    ``[N, D]``; ``m_i`` / ``l_i`` the running row max and sum ``[M]``, ``acc`` the running
    unnormalised output ``[M, D]`` (float32). A row that has seen no key yet keeps m = -inf,
    l = 0 and acc = 0. Returns the new ``(m_i, l_i, acc)``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def half_query(q, scale_log2):
    """The query of a tile loop over an fp8 cache, and its score scale: a 16-bit ``q`` ``[M, D]``
    becomes float16 (``q / c``, with ``c`` 1 or the power of two that brings max|q| to at most 2^15,
    since a bfloat16 query may exceed float16's range) and ``scale_log2`` becomes
    ``scale_log2 * c``; a float32 ``q`` is returned as it is (float32 dots). The tiles' fp8 values
    convert to float16 exactly and in one instruction per pair, where bfloat16 takes a second
    conversion per element (:func:`scaled_online_softmax_step`)."""
    if q.dtype.primitive_bitwidth == 16:
        top = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        c = tl.exp2(tl.maximum(tl.ceil(tl.log2(top)) - 15.0, 0.0))
        q = (q.to(tl.float32) / c).to(tl.float16)
        scale_log2 = scale_log2 * c
    return q, scale_log2


def fp8_word_loads(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether a compiled kernel reads rows of ``cache`` (``[..., head_dim]``, last dimension
    contiguous) with :func:`load_fp8_rows`: True for an fp8 cache on CUDA whose every row starts
    4-byte aligned (``head_dim``, the other strides and the base a multiple of 4 bytes); False for
    another dtype, and under the interpreter, which runs no inline assembly."""
    return (cache.dtype in FP8_DTYPES and not interpreted(cache) and head_dim % 4 == 0
            and cache.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in cache.stride()[:-1]))


@triton.jit
def load_fp8_rows(row_ptrs, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``[N, BLOCK_D]`` of an fp8 e4m3 / e5m2 tensor as float16, exactly (0 where ``row_mask``
    ``[N]`` is False and past ``HEAD_DIM``); ``row_ptrs`` ``[N]`` point at each row's first value,
    4-byte aligned (:func:`fp8_word_loads`). The rows are read as 32-bit words and each word becomes
    four float16 in registers: ``cvt.rn.f16x2.e4m3x2`` per pair for e4m3, and for e5m2 (float16's
    high byte) two ``prmt``. For a tile that is a dot's second operand with its reduction strided
    in memory (the values of ``p @ v``): docs/ops.md, "FP8 tiles, values read as words, float16
    dots". Compiled kernels only (inline PTX; e4m3 needs sm_89, as its cache does)."""
    w = tl.arange(0, BLOCK_D // 4)
    words = tl.load(row_ptrs[:, None].to(tl.pointer_type(tl.int32)) + w[None, :],
                    mask=row_mask[:, None] & (w < HEAD_DIM // 4)[None, :], other=0)
    if row_ptrs.dtype.element_ty == tl.float8e5:
        h0, h1, h2, h3 = tl.inline_asm_elementwise(
            "{ .reg .b32 z, a, b; mov.b32 z, 0; prmt.b32 a, $4, z, 0x1404; prmt.b32 b, $4, z, 0x3424; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        h0, h1, h2, h3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    # join(join(h0, h2), join(h1, h3))[n, w, i, j] is h_(2i + j): word w's values in order
    return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (row_ptrs.shape[0], BLOCK_D))


@triton.jit
def load_value_rows(row_ptrs, row_mask, d, d_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    FP8_WORDS: tl.constexpr):
    """A value tile ``[N, BLOCK_D]``: the rows at ``row_ptrs`` ``[N]`` (0 where ``row_mask`` or
    ``d_mask`` is False; ``d`` = ``arange(BLOCK_D)``), as stored, or with ``FP8_WORDS``
    (:func:`fp8_word_loads`) an fp8 cache's rows as float16 (:func:`load_fp8_rows`)."""
    if FP8_WORDS:
        v = load_fp8_rows(row_ptrs, row_mask, HEAD_DIM, BLOCK_D)
    else:
        v = tl.load(row_ptrs[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return v


@triton.jit
def scaled_online_softmax_step(q, k, v, k_scale, v_scale, n_mask, m_i, l_i, acc, scale_log2,
                               DOT_PRECISION: tl.constexpr):
    """:func:`online_softmax_step` over a tile of fp8 keys and values ``k``, ``v`` ``[N, D]`` (``v``
    fp8, or its values as float16 from :func:`load_fp8_rows`) with per-token float32 scales
    ``k_scale``, ``v_scale`` ``[N]`` (a key is ``k_n * k_scale_n``), from the query ``q`` ``[M, D]``
    (float32, or float16 from :func:`half_query`); ``n_mask`` ``[N]``: the tile's visible keys. The
    scales multiply the scores and the probabilities, not the tile: ``q . (s_n k_n) = s_n (q . k_n)``
    and ``sum_n p_n (t_n v_n) = sum_n (p_n t_n) v_n``, so the tile is only converted to q's dtype,
    which holds every fp8 e4m3 / e5m2 value exactly. With a float16 q, row m's weights enter the dot
    as ``p_mn t_n / W_m`` (W_m the row's largest ``p_mn t_n`` in the tile), at most 1 and in
    float16's normal range down to 2^-14 of the largest, whatever the scales (FlashAttention's
    float16 probabilities are relative to the row's largest in the same way), and the dot's row m is
    multiplied by W_m. Returns the new ``(m_i, l_i, acc)``."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if q.dtype == tl.float16:
        weights = p * v_scale[None, :]
        top = tl.max(weights, 1)
        top = tl.where(top > 0, top, 1.0)
        pv = tl.dot((weights * (1.0 / top)[:, None]).to(tl.float16), v.to(tl.float16), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv * top[:, None]
    else:
        acc = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), acc * alpha[:, None],
                     input_precision=DOT_PRECISION)
    return m_new, l_i, acc
