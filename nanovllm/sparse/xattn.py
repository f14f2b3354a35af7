"""XATTN_BSA: XAttention block-sparse prefill (Xu, Guo, Han et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025).

Per query block of ``block_size`` (128) tokens and per head, the key blocks are scored by
antidiagonal sums of ``stride x stride`` tiles, softmaxed per strided query row and summed per
block (:mod:`nanovllm.ops.xattn_estimate`), ``chunk_size`` query rows at a time; the fewest key
blocks whose scores reach ``threshold`` are kept, plus the sink block and the diagonal blocks
(:func:`nanovllm.ops.xattn_mask.xattn_block_mask`). The attention pipeline then attends to the
kept blocks only (:func:`nanovllm.ops.block_sparse_attention`). A context shorter than two sparse
blocks is dense; decode is full.
"""
from numbers import Real

import torch

from nanovllm.ops.xattn_mask import xattn_block_mask
from nanovllm.utils.checks import is_integer
from nanovllm.utils.ints import is_pow2
from nanovllm.sparse.policy import SparsePolicy, register_policy


def check_xattn_params(threshold, stride, block_size, chunk_size) -> None:
    """Raise ValueError naming the config field, the value and the limit: ``sparse_threshold``
    in [0, 1]; ``sparse_stride`` a power of two in [1, 64]; ``sparse_block_size`` a power of two
    in [16, 1024] and >= the stride; ``sparse_chunk_size`` a positive multiple of the block size."""
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"sparse_threshold must be in [0, 1], got {threshold!r}")
    if not is_pow2(stride) or stride > 64:
        raise ValueError(f"sparse_stride must be a power of two in [1, 64], got {stride!r}")
    if not is_pow2(block_size) or not 16 <= block_size <= 1024:
        raise ValueError(f"sparse_block_size must be a power of two in [16, 1024], got {block_size!r}")
    if stride > block_size:
        raise ValueError(f"sparse_stride={stride} must be <= sparse_block_size={block_size}")
    if not is_integer(chunk_size) or chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"sparse_chunk_size must be a positive multiple of sparse_block_size={block_size}, "
                         f"got {chunk_size!r}")


@register_policy
class XAttentionBSAPolicy(SparsePolicy):
    """Args: scale; threshold (cumulative block-score share kept per query block and head, in
    [0, 1]; 1.0 keeps every visible block, i.e. FULL's result); stride (antidiagonal stride, a
    power of two <= 64); block_size (sparse block in tokens, a power of two in [16, 1024]);
    chunk_size (query rows estimated per call, a multiple of block_size; bounds the memory).

    Raises:
        ValueError: a parameter out of range (see :func:`check_xattn_params`).
    """

    name = "XATTN_BSA"
    options = ("sparse_threshold", "sparse_stride", "sparse_block_size", "sparse_chunk_size")
    dense_prefill = False

    @classmethod
    def check_options(cls, config) -> None:
        check_xattn_params(config.sparse_threshold, config.sparse_stride, config.sparse_block_size,
                           config.sparse_chunk_size)

    @classmethod
    def from_config(cls, config, scale: float) -> "XAttentionBSAPolicy":
        return cls(scale, config.sparse_threshold, config.sparse_stride, config.sparse_block_size,
                   config.sparse_chunk_size)

    def __init__(self, scale: float, threshold: float = 0.97, stride: int = 8, block_size: int = 128,
                 chunk_size: int = 16384):
        super().__init__(scale)
        check_xattn_params(threshold, stride, block_size, chunk_size)
        self.threshold, self.stride = float(threshold), stride
        self.prefill_block_size, self.chunk_size = block_size, chunk_size

    def prefill_mask(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]``, or None (dense) for a
        context shorter than two sparse blocks."""
        if k.shape[0] < 2 * self.prefill_block_size:
            return None
        return xattn_block_mask(q, k, self.threshold, self.stride, self.prefill_block_size, self.scale,
                                self.chunk_size)
