"""XAttention's causal block mask over bounded query chunks (Xu et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025): :func:`xattn_block_mask` estimates and selects
``chunk_size`` query rows at a time, so memory stays bounded for long prompts.
"""

import torch

from nanovllm.utils.ints import cdiv

from .xattn_estimate import check_estimate_args, xattn_block_scores
from .xattn_select import xattn_select_blocks


def xattn_block_mask(
    q: torch.Tensor, k: torch.Tensor, threshold: float, stride: int = 8, block_size: int = 128,
    scale: float | None = None, chunk_size: int = 16384,
) -> torch.Tensor:
    """Causal XAttention block mask of q (the last ``Sq`` of the ``Sk`` keys), estimated and
    selected ``chunk_size`` query rows at a time.

    Equals ``xattn_select_blocks(xattn_block_scores(q, k, stride, block_size, scale),
    threshold, True, block_size, Sq, Sk)``, but a chunk only holds the block scores of its own
    rows against the keys it can see, so memory is bounded by ``chunk_size`` rows
    (the torch reference materialises ``chunk_size/S x Sk/S`` strided scores per head). Each
    chunk is one :func:`~nanovllm.ops.xattn_estimate.xattn_block_scores` call (one pass over its
    strided GEMM on CUDA) with the chunk's own ``offset``.

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hkv, D]`` with ``Sk >= Sq``, ``Hq % Hkv == 0``,
            ``1 <= D <= 256``, float16/bfloat16/float32.
        threshold: cumulative share to keep per query block, ``0 <= threshold <= 1``.
        stride, block_size, scale: as in :func:`~nanovllm.ops.xattn_estimate.xattn_block_scores`.
        chunk_size: query rows per estimation call, a positive multiple of ``block_size``.

    Returns:
        bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]`` on q's device.

    Raises:
        ValueError: bad shapes, stride, block_size or threshold, ``Sk < Sq``, or a chunk_size that
            is not a positive multiple of block_size.
    """
    stride, block_size = check_estimate_args(q, k, stride, block_size)
    seq_q, seq_k = q.shape[0], k.shape[0]
    if seq_k < seq_q:
        raise ValueError(f"causal prefill needs Sk >= Sq; got Sq={seq_q}, Sk={seq_k}")
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold={threshold} is outside 0..1")
    if not isinstance(chunk_size, int) or chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of block_size={block_size}")
    offset = seq_k - seq_q
    mask = torch.zeros((q.shape[1], cdiv(seq_q, block_size), cdiv(seq_k, block_size)), dtype=torch.bool,
                       device=q.device)
    for r0 in range(0, seq_q, chunk_size):
        r1 = min(r0 + chunk_size, seq_q)
        end = offset + r1  # keys the chunk's rows may see, up to its last strided key
        keys = k[:min(seq_k, cdiv(end, stride) * stride)]
        n_k = cdiv(end, block_size)
        scores = xattn_block_scores(q[r0:r1], keys, stride, block_size, scale, True, offset + r0)[:, :, :n_k]
        mask[:, r0 // block_size:cdiv(r1, block_size), :n_k] = xattn_select_blocks(
            scores, threshold, True, block_size, r1 - r0, end)
    return mask
