"""XATTN_BSA: XAttention block-sparse prefill (Xu, Guo, Han et al., "XAttention: Block Sparse
Attention with Antidiagonal Scoring", 2025).

Per query block of ``block_size`` (128) tokens and per head, the key blocks are scored by
antidiagonal sums of ``stride x stride`` tiles, softmaxed per strided query row and summed per
block (:mod:`nanovllm.ops.xattn_estimate`); the fewest key blocks whose scores reach
``threshold`` are kept, plus the sink block and the diagonal blocks; attention runs on the kept
blocks only (:func:`nanovllm.ops.block_sparse_attention`). Decode is full attention.

- **GPU-only mode** (:meth:`XAttentionBSAPolicy.paged_prefill_attention`): each sequence with at
  least two sparse blocks of context is estimated ``chunk_size`` query rows at a time over its
  whole context (a cached prefix is read through the block table), then attended block-sparsely;
  shorter sequences attend densely.
- **Offload mode** (:meth:`XAttentionBSAPolicy.attend_chunk`): the chunk's keys are in the prefill
  buffer, the earlier chunks' on the host. The estimation streams the earlier blocks' keys (no
  values) through the ring buffer twice, with the shared pipeline
  (``SparsePolicy._attend_cpu_blocks``): pass 1 merges per strided query row the softmax
  statistics over every earlier block and the chunk itself (causal); pass 2 sums each block's
  probabilities, normalised by those statistics, per (head, query block, key block). Selection
  runs on the concatenated [earlier blocks | chunk] scores. A CPU block is loaded (keys and
  values) when any head keeps any of its sparse blocks for any query block; inside a loaded block
  and inside the chunk only the kept sparse blocks are attended.
"""
import functools
from numbers import Real

import torch

from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy
from nanovllm.ops import block_sparse_attention, gather_kvcache, prefill_attention, xattn_select_blocks
from nanovllm.ops._triton import cdiv, is_pow2
from nanovllm.ops.xattn_estimate import normalise_block_rows
from nanovllm.ops.xattn_streamed import merge_row_stats, xattn_block_mask, xattn_block_sums, xattn_row_stats
from nanovllm.sampling_params import is_integer


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


@functools.lru_cache(maxsize=1024)
def causal_visible_blocks(seq_q: int, seq_k: int, block_size: int) -> int:
    """(query block, key block) pairs that some query may see when the ``seq_q`` queries are the
    last of ``seq_k`` keys (the ``visible`` of ``block_layout``, counted on the host)."""
    offset, n_k = seq_k - seq_q, cdiv(seq_k, block_size)
    return sum(max(0, min(n_k, (offset + min((qb + 1) * block_size, seq_q) - 1) // block_size + 1))
               for qb in range(cdiv(seq_q, block_size)))


class XAttentionBSAPolicy(SparsePolicy):
    """Args: scale; threshold (cumulative block-score share kept per query block and head, in
    [0, 1]; 1.0 keeps every visible block, i.e. FULL's result); stride (antidiagonal stride, a
    power of two <= 64); block_size (sparse block in tokens, a power of two in [16, 1024]; in
    offload mode it must divide the KV block size); chunk_size (query rows estimated per call in
    GPU-only mode, a multiple of block_size; offload mode estimates one prefill chunk at a time).

    Raises:
        ValueError: a parameter out of range (see :func:`check_xattn_params`).
    """

    dense_prefill = False

    def __init__(self, scale: float, threshold: float = 0.9, stride: int = 8, block_size: int = 128,
                 chunk_size: int = 16384):
        super().__init__(scale)
        check_xattn_params(threshold, stride, block_size, chunk_size)
        self.threshold, self.stride = float(threshold), stride
        self.block_size, self.chunk_size = block_size, chunk_size

    def initialize(self, offload_engine) -> None:
        """Raises ValueError unless the sparse block divides the offload KV block."""
        if offload_engine.block_size % self.block_size:
            raise ValueError(f"sparse_block_size={self.block_size} must divide "
                             f"kvcache_block_size={offload_engine.block_size}")

    def _record(self, layer_id: int, heads: int, seq_q: int, seq_k: int, mask: torch.Tensor | None = None):
        visible = heads * causal_visible_blocks(seq_q, seq_k, self.block_size)
        self.stats.add_compute(layer_id, visible if mask is None else mask.sum(), visible)

    # ---- GPU-only mode -----------------------------------------------------------------
    def paged_prefill_attention(self, q, k, v, context, k_cache, v_cache, layer_id: int) -> torch.Tensor:
        """Block-sparse prefill of every sequence with at least ``2 * block_size`` tokens of
        context; shorter ones attend densely (all at once when no sequence is long). Shapes and
        arguments as :meth:`SparsePolicy.paged_prefill_attention`; the keys of a cached prefix
        (or of earlier prefill chunks) come from ``k_cache``/``v_cache`` through
        ``context.block_tables``, where ``store_kvcache`` already put the new tokens."""
        lens = list(zip(context.seqlens_q, context.seqlens_k))
        if all(len_k < 2 * self.block_size for _, len_k in lens):
            for len_q, len_k in lens:
                self._record(layer_id, q.shape[1], len_q, len_k)
            return super().paged_prefill_attention(q, k, v, context, k_cache, v_cache, layer_id)
        out, start = torch.empty_like(q), 0
        for i, (len_q, len_k) in enumerate(lens):
            rows, start = slice(start, start + len_q), start + len_q
            table = None if len_k == len_q else context.block_tables[i]
            if len_q:
                out[rows] = self._prefill_sequence(q[rows], k[rows], v[rows], len_k, k_cache, v_cache, table,
                                                   layer_id)
        return out

    def _prefill_sequence(self, q, k, v, len_k, k_cache, v_cache, table, layer_id):
        if len_k < 2 * self.block_size:
            self._record(layer_id, q.shape[1], q.shape[0], len_k)
            return prefill_attention(q, k, v, [q.shape[0]], [len_k], self.scale, k_cache, v_cache,
                                     None if table is None else table[None])
        if table is not None:
            k = gather_kvcache(k_cache, table, len_k).to(q.dtype)
            v = gather_kvcache(v_cache, table, len_k).to(q.dtype)
        mask = xattn_block_mask(q, k, self.threshold, self.stride, self.block_size, self.scale, self.chunk_size)
        self._record(layer_id, q.shape[1], q.shape[0], len_k, mask)
        return block_sparse_attention(q, k, v, mask, self.block_size, self.scale, causal=True)[0]

    # ---- offload mode ------------------------------------------------------------------
    def block_scores(self, q, k, offload_engine, ctx: PolicyContext) -> torch.Tensor:
        """XAttention block scores of a prefill chunk over all of its context, streamed.

        Args:
            q: ``[Sq, Hq, D]`` the chunk's queries; k: ``[Sq, Hkv, D]`` its keys (prefill buffer).
            offload_engine, ctx: the earlier chunks are ``ctx.cpu_blocks`` (full blocks).

        Returns:
            float32 ``[Hq, ceil(Sq/bs), n_cpu * B/bs + ceil(Sq/bs)]`` (bs the sparse block, B the
            KV block), equal to ``xattn_block_scores(q, cat(earlier keys, k))``: two key-only
            passes over the CPU blocks through the ring buffer (statistics, then block sums).
        """
        stats = xattn_row_stats(q, k, self.stride, self.scale, causal=True)

        def merge_stats(k_block, index):
            nonlocal stats
            stats = merge_row_stats(*stats, *xattn_row_stats(q, k_block, self.stride, self.scale, causal=False))

        sums = [None] * len(ctx.cpu_blocks)  # by block index: the visiting order does not matter

        def block_sums(k_block, index):
            sums[index] = xattn_block_sums(q, k_block, *stats, self.stride, self.block_size, self.scale,
                                           causal=False)

        self._attend_cpu_blocks(q, None, offload_engine, ctx, visit=merge_stats)
        self._attend_cpu_blocks(q, None, offload_engine, ctx, visit=block_sums)
        self.stats.add_estimate_loads(ctx.layer_id, 2 * len(ctx.cpu_blocks))
        sums.append(xattn_block_sums(q, k, *stats, self.stride, self.block_size, self.scale, causal=True))
        return normalise_block_rows(torch.cat(sums, dim=-1))

    def attend_chunk(self, q, k, v, offload_engine, ctx: PolicyContext):
        """Estimate and select the chunk's block mask (kept in ``ctx.extra``), choose the CPU
        blocks to load, and attend block-sparsely over the chunk itself (causal). A context
        shorter than two sparse blocks attends densely."""
        seq_q, history = q.shape[1], sum(ctx.block_lens)
        if history + seq_q < 2 * self.block_size:
            self._record(ctx.layer_id, q.shape[2], seq_q, history + seq_q)
            return super().attend_chunk(q, k, v, offload_engine, ctx)
        mask = xattn_select_blocks(self.block_scores(q[0], k, offload_engine, ctx), self.threshold, True,
                                   self.block_size, seq_q, history + seq_q)
        self._record(ctx.layer_id, q.shape[2], seq_q, history + seq_q, mask)
        per_block = offload_engine.block_size // self.block_size
        n_cpu = len(ctx.cpu_blocks)
        rows = mask.shape[0] * mask.shape[1]
        kept = mask[:, :, :n_cpu * per_block].reshape(rows, n_cpu, per_block).any(-1).any(0)
        ctx.extra.update(mask=mask, per_block=per_block, chosen=kept.nonzero().flatten().tolist())  # host sync
        out, lse = block_sparse_attention(q[0], k, v, mask[:, :, n_cpu * per_block:], self.block_size, self.scale,
                                          causal=True)
        return out.unsqueeze(0), lse.unsqueeze(0)

    def select_blocks(self, available: list[int], offload_engine, ctx: PolicyContext,
                      q: torch.Tensor) -> list[int]:
        """Prefill: the CPU blocks :meth:`attend_chunk` chose; decode: every block."""
        return ctx.extra.get("chosen", available) if ctx.is_prefill else available

    def attend_block(self, q, k, v, ctx: PolicyContext, index: int):
        """Prefill: attention restricted to the kept sparse blocks of CPU block ``index``."""
        mask = ctx.extra.get("mask")
        if mask is None:
            return super().attend_block(q, k, v, ctx, index)
        first = index * ctx.extra["per_block"]
        columns = mask[:, :, first:first + cdiv(k.shape[0], self.block_size)]
        out, lse = block_sparse_attention(q[0], k, v, columns, self.block_size, self.scale, causal=False)
        return out.unsqueeze(0), lse.unsqueeze(0)

