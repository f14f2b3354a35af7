"""XAttention block-importance estimation for block-sparse prefill.

Algorithm: XAttention (Xu, Guo, Han et al., "XAttention: Block Sparse Attention with Antidiagonal
Scoring", 2025). The sum of the attention scores along antidiagonals of each ``stride x stride``
tile is a cheap proxy for the tile's total; it is computed for every tile at once as one GEMM of
stride-interleaved ("reshaped") Q and K, softmaxed at that reduced resolution and summed into
``block_size x block_size`` blocks. Per query block the highest-scoring key blocks are kept until
their cumulative share reaches a threshold (:mod:`nanovllm.ops.xattn_select`). The selected mask
drives :func:`nanovllm.ops.block_sparse_attention.block_sparse_attention`.

Positions: queries are the last ``Sq`` of the ``Sk`` keys (bottom-right aligned, as in
:func:`nanovllm.ops.flash_attn_with_lse`): local query row ``i`` sits at key position
``Sk - Sq + i``, or ``offset + i`` where an estimate takes an explicit ``offset``. Query block
``b`` is rows ``b*block_size .. (b+1)*block_size - 1`` (local), key block ``c`` is key positions
``c*block_size ..``; the last block of each may be partial.

This module holds the definition (:func:`xattn_block_scores`), its argument checks and the torch
reference (:func:`xattn_block_scores_ref`); the Triton kernels, the CUDA path (or Triton's
interpreter), are in :mod:`nanovllm.ops.xattn_estimate_triton`.
"""

import torch

from nanovllm.utils.ints import cdiv, is_pow2

from ._triton import (check_causal, check_float_dtype, check_gqa, check_head_dim, check_offset, check_same_device,
                      check_scale)
from .backend import use_triton
from .xattn_estimate_triton import launch_block_scores


def _check_qk(q: torch.Tensor, k: torch.Tensor, stride: int) -> int:
    """Raise ValueError for bad q/k/stride (see :func:`xattn_block_scores`); returns stride as an
    int (numpy integers pass the check and must not reach Triton)."""
    check_same_device(q=q, k=k)
    if q.dim() != 3 or k.dim() != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q [Sq, Hq, D] and k [Sk, Hkv, D] with one D; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])
    check_float_dtype(q=q, k=k)
    if not is_pow2(stride) or stride > 64:
        raise ValueError(f"stride={stride!r} must be a power of two in 1..64")
    return int(stride)


def query_offset(q: torch.Tensor, k: torch.Tensor, offset) -> int:
    """The key position of query row 0: ``offset`` checked to be an int, default ``Sk - Sq``."""
    offset = check_offset(offset)
    return k.shape[0] - q.shape[0] if offset is None else offset


def check_estimate_args(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> tuple[int, int]:
    """The arguments of an estimate (:func:`xattn_block_scores`): q ``[Sq, Hq, D]`` and k ``[Sk, Hkv,
    D]`` on one device with one D and one float dtype, GQA heads, a supported head_dim, ``stride`` a
    power of two in 1..64 and ``block_size`` a power of two in stride..1024. Returns ``(stride,
    block_size)`` as ints (numpy integers pass the check and must not reach Triton).

    Raises:
        ValueError: naming the argument and the value.
    """
    stride = _check_qk(q, k, stride)
    if not is_pow2(block_size) or block_size < stride or block_size > 1024:
        raise ValueError(
            f"block_size={block_size!r} must be a power of two in stride={stride}..1024"
        )
    return stride, int(block_size)


def _strided_layout(q: torch.Tensor, k: torch.Tensor, stride: int, causal: bool, offset: int):
    """Torch form of steps 1-2 of :func:`xattn_block_scores` for the references:
    ``(q_str [Hq, n_qs, S*D], k_str [Hkv, n_ks, S*D], visible bool [n_qs, n_ks])`` in float32
    (float64 inputs: float64), with query row 0 at key position ``offset``."""
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    n_qs, n_ks = cdiv(seq_q, stride), cdiv(seq_k, stride)
    q_pad = torch.zeros((n_qs * stride, heads_q, dim), dtype=dtype, device=q.device)
    q_pad[:seq_q] = q
    k_pad = torch.zeros((n_ks * stride, heads_kv, dim), dtype=dtype, device=q.device)
    k_pad[:seq_k] = k
    # Q'[h, r] = concat_i q[r*stride + stride-1-i, h]; K'[g, j] = concat_i k[j*stride + i, g].
    q_str = q_pad.view(n_qs, stride, heads_q, dim).flip(1).permute(2, 0, 1, 3).reshape(heads_q, n_qs, stride * dim)
    k_str = k_pad.view(n_ks, stride, heads_kv, dim).permute(2, 0, 1, 3).reshape(heads_kv, n_ks, stride * dim)
    rows = torch.arange(n_qs, device=q.device)
    cols = torch.arange(n_ks, device=q.device)
    if causal:
        visible = cols[None, :] * stride <= offset + rows[:, None] * stride + stride - 1
    else:
        visible = torch.ones((n_qs, n_ks), dtype=torch.bool, device=q.device)
    return q_str, k_str, visible


def xattn_block_scores_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    stride: int = 8,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
    offset: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`xattn_block_scores` (same arguments and result) and of its
    Triton kernels (:mod:`nanovllm.ops.xattn_estimate_triton`).

    Materialises the reshaped Q'/K' and one head's ``[Sq/stride, Sk/stride]`` score matrix at a
    time, in float32 (float64 inputs compute in float64); the result is float32.
    """
    stride, block_size = check_estimate_args(q, k, stride, block_size)
    offset = query_offset(q, k, offset)
    scale, causal = check_scale(scale), check_causal(causal)
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    group = heads_q // heads_kv
    tile = block_size // stride
    n_q, n_k = cdiv(seq_q, block_size), cdiv(seq_k, block_size)
    out = torch.zeros((heads_q, n_q, n_k), dtype=torch.float32, device=q.device)
    if seq_q == 0 or seq_k == 0:
        return out
    q_str, k_str, visible = _strided_layout(q, k, stride, causal, offset)
    n_qs, n_ks = visible.shape
    any_visible = visible.any(-1, keepdim=True)
    for h in range(heads_q):
        scores = (q_str[h] @ k_str[h // group].T) * (scale / stride)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.where(any_visible, torch.softmax(scores, dim=-1), 0.0)
        padded = torch.zeros((n_q * tile, n_k * tile), dtype=q_str.dtype, device=q.device)
        padded[:n_qs, :n_ks] = probs
        out[h] = padded.view(n_q, tile, n_k, tile).sum(dim=(1, 3)).float()
    return normalise_block_rows(out)


def normalise_block_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row ``scores[..., qb, :]`` divided by its sum (rows summing to 0 stay 0): step 5 of
    :func:`xattn_block_scores`, for block sums assembled from pieces."""
    total = scores.sum(-1, keepdim=True)
    return torch.where(total > 0, scores / torch.where(total > 0, total, 1.0), 0.0)


def xattn_block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    stride: int = 8,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
    offset: int | None = None,
) -> torch.Tensor:
    """XAttention antidiagonal block-importance scores.

    With ``S = stride``, ``T = block_size // S``, zero rows appended to q and k up to multiples
    of S, and for each q head ``h`` (kv head ``g = h // (Hq // Hkv)``):

    1. reshape (inverse mode): ``Q'[r] = concat_{i<S} q[r*S + S-1-i, h]`` and
       ``K'[j] = concat_{i<S} k[j*S + i, g]`` (length ``S*D``), for ``r < ceil(Sq/S)``,
       ``j < ceil(Sk/S)``; so ``Q'[r].K'[j]`` is the sum of q.k along the antidiagonal of the
       ``S x S`` tile (query rows ``r*S..``, keys ``j*S..``);
    2. ``A[r, j] = Q'[r].K'[j] * scale / S``; causal: ``A[r, j] = -inf`` unless
       ``j*S <= offset + r*S + S - 1`` (the tile's first key is at or before its last query
       position; by default ``offset = Sk - Sq``, bottom-right alignment);
    3. ``P = softmax_j(A)`` per strided row (a row with no visible key is all 0);
    4. ``B[qb, kb] = sum of P[r, j]`` over ``r // T == qb``, ``j // T == kb``;
    5. each row ``B[qb, :]`` divided by its sum (rows summing to 0 stay 0).

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hkv, D]``; ``Hq % Hkv == 0``, ``1 <= D <= 256``;
            float16/bfloat16/float32 (float64 goes to the reference); last dim contiguous or not.
        stride: S, a power of two in 1..64 (paper default 8; 16 is cheaper and coarser).
        block_size: a power of two in ``stride..1024``; tokens per query/key block.
        scale: softmax scale of the real attention, a finite real > 0 (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask (queries are the last Sq of the Sk keys).
        offset: int, the key position of query row 0 when causal (default ``Sk - Sq``; ignored
            when not causal). Any int: negative puts the first rows before every key (their
            rows are 0), past ``Sk - Sq`` lets rows see all keys. Used for a chunk of query rows
            estimated against keys that run on past the chunk's last row (cut at a stride
            multiple), as :func:`nanovllm.ops.xattn_mask.xattn_block_mask` does.

    Returns:
        float32 ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]``, each row summing to 1 (0
        where the query block sees no key); causally hidden blocks are exactly 0.

    Raises:
        ValueError: q/k not 3-D or differing in D, Hq not a multiple of Hkv, D outside 1..256,
            q and k not of one float dtype, stride or block_size not a power of two in range,
            offset not an int, scale not a finite real > 0, causal not a bool.

    CUDA: the strided GEMM is computed once, in two Triton kernels. Pass A runs over tiles of
    128 strided rows x N strided keys (N = max(128, T), fewer rows when T > 128; 64 x max(64, T)
    where a head_dim row is over 256 bytes), the reshape done by the loads (no copy): TMA bulk
    copies through descriptors over q and k viewed as ``[rows / S, S * row stride]`` when Sq and
    Sk are multiples of S (``_strided_descriptors``; docs/benchmarks.md, 'XAttention kernels'), else strided
    pointer loads; causally hidden key tiles skipped; per tile it updates each row's
    online-softmax max and sum (FA-2) and writes the row's partial block sums
    ``exp2(A - m_tile)`` with ``m_tile``, the running max they were taken against. Pass B
    (memory-bound) rescales them to each row's final max and sum, sums them over the block's rows
    and divides by the number of rows that see a key (step 5).
    ``Hq * Sq * Sk * D / S`` multiply-adds (causal: about half), 1/S of QK^T's. Scratch: float32
    partial sums, tile maxima and row statistics,
    ``4 * Hq * ceil(Sq/S) * (ceil(Sk/block_size) + ceil(Sk/(S*N)) + 2)`` bytes (152 MB for
    Sq = Sk = 32K, Hq = 32, S = 8, block_size = 128).
    Kernels and their launch: :mod:`nanovllm.ops.xattn_estimate_triton`.
    CPU: :func:`xattn_block_scores_ref` (or the kernels under the interpreter, see
    ``nanovllm.ops._triton``).
    """
    stride, block_size = check_estimate_args(q, k, stride, block_size)
    offset = query_offset(q, k, offset)
    scale, causal = check_scale(scale), check_causal(causal)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if q.dtype == torch.float64 or not use_triton(q) or q.shape[0] == 0 or k.shape[0] == 0:
        return xattn_block_scores_ref(q, k, stride, block_size, scale, causal, offset)
    return launch_block_scores(q, k, stride, block_size, scale, causal, offset)
