"""Packed variable-length causal prefill attention, optionally over a paged cached prefix."""

import itertools
import logging

import torch

from ._triton import cdiv, check_gqa, check_head_dim
from .chunked_attention import flash_attn_with_lse, flash_attn_with_lse_ref, merge_attention_outputs
from .store_kv import gather_kvcache

logger = logging.getLogger(__name__)

_VARLEN_MAX_MEAN_TOKENS = 1024
"""Mean new tokens per sequence up to which a multi-sequence prefill uses one varlen launch."""
_varlen_failed: set = set()
"""(dtype, head_dim) for which torch's varlen FlashAttention-2 raised once; not retried."""


def _check_packed(q, k, v) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [Nq, Hq, D] and k, v [Nq, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in tokens or head_dim")
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])


def _check_lengths(num_tokens: int, seqlens_q: list[int], seqlens_k: list[int]) -> None:
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(f"len(seqlens_q)={len(seqlens_q)} != len(seqlens_k)={len(seqlens_k)}")
    if sum(seqlens_q) != num_tokens:
        raise ValueError(f"sum(seqlens_q)={sum(seqlens_q)} != num_tokens={num_tokens} of q")
    for i, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
        if len_q < 0 or len_k < len_q:
            raise ValueError(f"sequence {i}: need 0 <= seqlens_q={len_q} <= seqlens_k={len_k}")


def _check_prefixes(k, seqlens_q, seqlens_k, prefixes) -> None:
    for i, (k_pre, v_pre) in prefixes.items():
        if not 0 <= i < len(seqlens_q):
            raise ValueError(f"prefixes has sequence {i}, outside 0..{len(seqlens_q) - 1}")
        shape = (seqlens_k[i] - seqlens_q[i], *k.shape[1:])
        if tuple(k_pre.shape) != shape or tuple(v_pre.shape) != shape:
            raise ValueError(f"prefixes[{i}] must be two tensors of shape {shape}; got {tuple(k_pre.shape)} and "
                             f"{tuple(v_pre.shape)}")


def _check_cache(k, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes) -> None:
    prefixed = [(len_k - len_q, len_k) for i, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k))
                if len_k > len_q and i not in prefixes]
    if not prefixed:
        return
    if k_cache is None or v_cache is None or block_tables is None:
        raise ValueError(
            f"a cached prefix of {max(prefixed)[0]} tokens needs k_cache, v_cache and block_tables"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] < len(seqlens_q):
        raise ValueError(
            f"block_tables must be [>= {len(seqlens_q)} sequences, max_blocks]; got {tuple(block_tables.shape)}"
        )
    need = cdiv(max(len_k for _, len_k in prefixed), k_cache.shape[1])
    if need > block_tables.shape[1]:
        raise ValueError(
            f"a context of a prefixed sequence needs {need} blocks but block_tables has {block_tables.shape[1]} columns"
        )


def _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes) -> None:
    _check_packed(q, k, v)
    _check_lengths(q.shape[0], seqlens_q, seqlens_k)
    _check_prefixes(k, seqlens_q, seqlens_k, prefixes)
    _check_cache(k, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes)


def _sequences(seqlens_q: list[int], seqlens_k: list[int]):
    """Yield (index, rows slice, cached prefix length) of each non-empty sequence."""
    start = 0
    for i, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
        if len_q:
            yield i, slice(start, start + len_q), len_k - len_q
        start += len_q


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    """int32 [0, l0, l0+l1, ...] on device, copied from pinned memory without a host sync."""
    host = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).pin_memory()
    return host.to(device, non_blocking=True)


def _prefix(which: int, i: int, num_tokens: int, cache, block_tables, prefixes, dtype) -> torch.Tensor:
    """The first ``num_tokens`` keys (which=0) or values (1) of sequence i: given in
    ``prefixes``, or gathered from the paged cache."""
    if i in prefixes:
        return prefixes[i][which].to(dtype)
    return gather_kvcache(cache, block_tables[i], num_tokens).to(dtype)


def _packed_context(which, k, cache, seqs, block_tables, prefixes) -> torch.Tensor:
    """Keys (or values) of all sequences packed: the new rows, each prefixed sequence's prefix
    inserted before its rows. The rows between two prefixes are one slice (a chunk usually has
    one prefixed sequence: one cat of three pieces, not a slice per sequence)."""
    pieces, start = [], 0
    for i, rows, prefix in seqs:
        if prefix:
            pieces += [k[start:rows.start], _prefix(which, i, prefix, cache, block_tables, prefixes, k.dtype)]
            start = rows.start
    if not pieces:
        return k
    return torch.cat([*pieces, k[start:]])


def _prefill_varlen(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes):
    """All sequences in one launch of torch's varlen FlashAttention-2 (GQA native, causal mask
    bottom-right aligned per sequence)."""
    seqs = list(_sequences(seqlens_q, seqlens_k))
    keys = _packed_context(0, k, k_cache, seqs, block_tables, prefixes)
    values = _packed_context(1, v, v_cache, seqs, block_tables, prefixes)
    lens_q = [seqlens_q[i] for i, _, _ in seqs]
    lens_k = [seqlens_k[i] for i, _, _ in seqs]
    return torch.ops.aten._flash_attention_forward(
        q, keys, values, _cumulative(lens_q, q.device), _cumulative(lens_k, q.device),
        max(lens_q), max(lens_k), 0.0, True, False, scale=scale,
    )[0]


def _prefill_per_sequence(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes):
    """Per sequence: causal over its new rows, non-causal over its gathered prefix, LSE merge."""
    out = torch.empty_like(q)
    for i, rows, prefix in _sequences(seqlens_q, seqlens_k):
        q_i = q[None, rows]
        o, lse = flash_attn_with_lse(q_i, k[None, rows], v[None, rows], scale, True)
        if prefix:
            k_pre = _prefix(0, i, prefix, k_cache, block_tables, prefixes, k.dtype)
            v_pre = _prefix(1, i, prefix, v_cache, block_tables, prefixes, v.dtype)
            o_pre, lse_pre = flash_attn_with_lse(q_i, k_pre[None], v_pre[None], scale, False)
            o = merge_attention_outputs(o, lse, o_pre, lse_pre)[0]
        out[rows] = o[0]
    return out


def _use_varlen(q: torch.Tensor, seqlens_q: list[int]) -> bool:
    """Several short sequences in fp16/bf16 on CUDA: each per-sequence step costs host time, while
    varlen FlashAttention-2 runs at a fraction of cuDNN's rate, so many short sequences go through
    varlen and few long ones through cuDNN (docs/ops.md, 'prefill_attention.py')."""
    lengths = [n for n in seqlens_q if n]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and (q.dtype, q.shape[2]) not in _varlen_failed
            and len(lengths) > 1 and sum(lengths) <= _VARLEN_MAX_MEAN_TOKENS * len(lengths))


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_q: list[int],
    seqlens_k: list[int],
    scale: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Reference of :func:`prefill_attention`: per sequence, one fp32 causal softmax over
    [prefix, new rows] (same arguments and result)."""
    prefixes = prefixes or {}
    _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes)
    out = torch.empty_like(q)
    for i, rows, prefix in _sequences(seqlens_q, seqlens_k):
        keys, values = k[rows], v[rows]
        if prefix:
            keys = torch.cat([_prefix(0, i, prefix, k_cache, block_tables, prefixes, k.dtype), keys])
            values = torch.cat([_prefix(1, i, prefix, v_cache, block_tables, prefixes, v.dtype), values])
        out[rows] = flash_attn_with_lse_ref(q[None, rows], keys[None], values[None], scale, True)[0][0]
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_q: list[int],
    seqlens_k: list[int],
    scale: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Packed variable-length causal prefill attention.

    Args:
        q: ``[Nq, Hq, D]``; k, v: ``[Nq, Hkv, D]`` (the new tokens), ``Hq % Hkv == 0``,
            ``1 <= D <= 256``. Sequence i owns rows ``sum(seqlens_q[:i]) ..+ seqlens_q[i]``.
        seqlens_q: host list of new-token counts per sequence (0 allowed: nothing to do).
        seqlens_k: host list of total context lengths, ``seqlens_k[i] >= seqlens_q[i]``. The
            keys ``0 .. seqlens_k[i] - 1`` of a sequence with a prefix (cached prefix or earlier
            chunks) are in the paged cache at ``block_tables[i]``, the new ones already stored
            there by :func:`store_kvcache`; the new keys are also the k/v rows.
        scale: softmax scale (usually ``D ** -0.5``).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; needed only when a prefix exists.
        block_tables: int32 ``[>= num_seqs, max_blocks]`` block ids, covering the whole context
            of each sequence that has a prefix (except those in ``prefixes``).
        prefixes: ``{i: (k_prefix, v_prefix)}``, each ``[seqlens_k[i] - seqlens_q[i], Hkv, D]``:
            the prefix of sequence i, already gathered (e.g. from two KV tiers), instead of the
            cache's.

    Returns:
        ``[Nq, Hq, D]`` in q.dtype; query j of sequence i sits at position
        ``seqlens_k[i] - seqlens_q[i] + j`` and sees keys up to it (causal).

    Raises:
        ValueError: inconsistent shapes or lengths, a prefix without cache/block tables, a
            block table too short for a prefixed context, or a given prefix of the wrong shape
            (messages give the value and the limit).

    CUDA, several sequences of at most 1024 new tokens on average in fp16/bf16: one varlen
    FlashAttention-2 launch (``torch.ops.aten._flash_attention_forward``, GQA native, bottom-right
    causal) over packed keys: the new k/v rows, or for a sequence with a prefix its whole context
    gathered from the cache. Otherwise (or if that kernel raises), per
    sequence: the new rows attend causally to themselves and non-causally to the prefix gathered
    from the cache, each through :func:`flash_attn_with_lse` (cuDNN), merged by LSE with
    :func:`merge_attention_outputs`. Host lists mean no device sync on either path.
    CPU: the per-sequence path over torch's fused CPU attention (:func:`prefill_attention_ref`
    is the plain-math reference).
    """
    prefixes = prefixes or {}
    _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes)
    args = (q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes)
    if _use_varlen(q, seqlens_q):
        try:
            return _prefill_varlen(*args)
        except RuntimeError as err:
            _varlen_failed.add((q.dtype, q.shape[2]))
            logger.warning("varlen FlashAttention-2 unavailable for %s head_dim %d: %s", q.dtype, q.shape[2], err)
    return _prefill_per_sequence(*args)
