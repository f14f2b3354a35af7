"""Packed variable-length causal prefill attention, optionally over a paged cached prefix."""

import itertools
import logging
from typing import Callable

import torch

from nanovllm.utils.ints import cdiv

from ._triton import check_gqa, check_head_dim
from .chunked_attention import flash_attn_with_lse, flash_attn_with_lse_ref, merge_attention_outputs
from .kv_quant import check_scales
from .window_attention import (check_window, flash_window, gather_tokens, sliding_window_attention,
                               sliding_window_attention_ref, window_start)

logger = logging.getLogger(__name__)

_VARLEN_MAX_MEAN_TOKENS = 1024
"""Mean new tokens per sequence up to which a multi-sequence prefill uses one varlen launch."""
_varlen_failed: set = set()
"""(dtype, head_dim) for which torch's varlen FlashAttention-2 raised once; not retried."""
PREFIX_SEGMENT_BYTES = 128 << 20
"""Bytes of a cached prefix's keys, in the queries' dtype, that one sequence's chunk attends to at
once: a longer prefix is gathered (and dequantized) and attended a segment at a time, the segments
merged by LSE, so a prefill's transient memory does not grow with the context."""

PrefixReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``read(first, last)``: the keys and values of one sequence's prefix tokens ``first .. last - 1``,
each ``[last - first, Hkv, D]`` in the queries' dtype (e.g. gathered from two KV tiers)."""


def segment_tokens(k: torch.Tensor, block_size: int | None) -> int:
    """Prefix tokens attended at once (:data:`PREFIX_SEGMENT_BYTES` of rows like ``k`` ``[N, Hkv,
    D]``): a multiple of ``block_size`` (at least one block) when the prefix is paged."""
    tokens = max(1, PREFIX_SEGMENT_BYTES // (k.shape[1] * k.shape[2] * k.element_size()))
    return tokens if not block_size else max(block_size, tokens // block_size * block_size)


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


def _check_prefixes(k, seqlens_q, seqlens_k, prefixes, window) -> None:
    for i, given in prefixes.items():
        if not 0 <= i < len(seqlens_q):
            raise ValueError(f"prefixes has sequence {i}, outside 0..{len(seqlens_q) - 1}")
        if callable(given):
            continue  # a reader's rows are checked as read
        k_pre, v_pre = given
        prefix = seqlens_k[i] - seqlens_q[i]
        shape = (prefix, *k.shape[1:])
        if window is not None and k_pre.shape == v_pre.shape and tuple(k_pre.shape[1:]) == shape[1:] and \
                prefix - window_start(prefix, window) <= k_pre.shape[0] <= prefix:
            continue  # a window needs only the prefix's last tokens
        if tuple(k_pre.shape) != shape or tuple(v_pre.shape) != shape:
            least = "" if window is None else f" (or its last {prefix - window_start(prefix, window)} or more rows)"
            raise ValueError(f"prefixes[{i}] must be two tensors of shape {shape}{least}; got {tuple(k_pre.shape)} "
                             f"and {tuple(v_pre.shape)}")


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


def _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes, window, k_scale,
                        v_scale) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ValueError unless the arguments fit; returns the caches' scales ``(k_scale, v_scale)`` (None
    for caches that are not fp8)."""
    _check_packed(q, k, v)
    if window is not None:
        check_window(window)
    _check_lengths(q.shape[0], seqlens_q, seqlens_k)
    _check_prefixes(k, seqlens_q, seqlens_k, prefixes, window)
    _check_cache(k, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes)
    if k_cache is not None:
        check_scales(k_cache, k_scale, "k_scale")
        check_scales(v_cache, v_scale, "v_scale")
    return None if k_scale is None else (k_scale, v_scale)


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


def _prefix_rows(i: int, num_tokens: int, first: int, last: int, k_cache, v_cache, block_tables, prefixes,
                 dtype, kv_scales=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[last - first, Hkv, D]`` in ``dtype`` of the prefix tokens ``first .. last -
    1`` of sequence i (whose prefix has ``num_tokens``): read by its reader or sliced from its tensors
    (their last rows) in ``prefixes``, or gathered from the paged cache (only the blocks holding them;
    an fp8 cache's dequantized by ``kv_scales``)."""
    given = prefixes.get(i)
    if given is None:
        k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
        return (gather_tokens(k_cache, block_tables[i], first, last, k_scale, dtype),
                gather_tokens(v_cache, block_tables[i], first, last, v_scale, dtype))
    if not callable(given):
        offset = num_tokens - given[0].shape[0]
        return tuple(t[first - offset:last - offset].to(dtype) for t in given)
    k_pre, v_pre = given(first, last)
    if k_pre.shape != v_pre.shape or k_pre.shape[0] != last - first or k_pre.dtype != dtype:
        raise ValueError(f"the reader of prefixes[{i}] must return two {dtype} tensors of {last - first} rows for "
                         f"tokens {first}..{last - 1}; got {k_pre.dtype} {tuple(k_pre.shape)} and {v_pre.dtype} "
                         f"{tuple(v_pre.shape)}")
    return k_pre, v_pre


def _packed_context(k, v, k_cache, v_cache, seqs, block_tables, prefixes, window=None,
                    kv_scales=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of all sequences packed: the new rows, each prefixed sequence's prefix (the
    part the window shows) inserted before its rows. The rows between two prefixes are one slice
    (a chunk usually has one prefixed sequence: one cat of three pieces, not a slice per sequence)."""
    keys, values, start = [], [], 0
    for i, rows, prefix in seqs:
        if prefix:
            k_pre, v_pre = _prefix_rows(i, prefix, window_start(prefix, window), prefix, k_cache, v_cache,
                                        block_tables, prefixes, k.dtype, kv_scales)
            keys += [k[start:rows.start], k_pre]
            values += [v[start:rows.start], v_pre]
            start = rows.start
    if not keys:
        return k, v
    return torch.cat([*keys, k[start:]]), torch.cat([*values, v[start:]])


def _prefill_varlen(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes, kv_scales,
                    window=None):
    """All sequences in one launch of torch's varlen FlashAttention-2 (GQA native, causal mask
    bottom-right aligned per sequence; with a window, its band, over only the prefix tokens the
    window shows)."""
    seqs = list(_sequences(seqlens_q, seqlens_k))
    keys, values = _packed_context(k, v, k_cache, v_cache, seqs, block_tables, prefixes, window, kv_scales)
    lens_q = [seqlens_q[i] for i, _, _ in seqs]
    lens_k = [seqlens_k[i] - window_start(prefix, window) for i, _, prefix in seqs]
    cu_q, cu_k = _cumulative(lens_q, q.device), _cumulative(lens_k, q.device)
    if window is not None:
        return flash_window(q, keys, values, cu_q, cu_k, max(lens_q), max(lens_k), scale, window)
    return torch.ops.aten._flash_attention_forward(q, keys, values, cu_q, cu_k, max(lens_q), max(lens_k), 0.0,
                                                   True, False, scale=scale)[0]


def _prefill_window(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes, kv_scales,
                    window, attend=sliding_window_attention):
    """Per sequence: its chunk over [the prefix tokens the window shows, its new rows] through
    ``attend`` (:func:`sliding_window_attention` or its reference)."""
    out = torch.empty_like(q)
    for i, rows, prefix in _sequences(seqlens_q, seqlens_k):
        keys, values = k[rows], v[rows]
        if prefix:
            k_pre, v_pre = _prefix_rows(i, prefix, window_start(prefix, window), prefix, k_cache, v_cache,
                                        block_tables, prefixes, k.dtype, kv_scales)
            keys, values = torch.cat([k_pre, keys]), torch.cat([v_pre, values])
        out[rows] = attend(q[rows], keys, values, scale, window)
    return out


def _prefill_per_sequence(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes,
                          kv_scales, segment):
    """Per sequence: causal over its new rows, then non-causal over its prefix ``segment`` tokens
    (:func:`segment_tokens`) at a time, each gathered when attended and merged by LSE (in float32
    when the prefix has several segments)."""
    out = torch.empty_like(q)
    for i, rows, prefix in _sequences(seqlens_q, seqlens_k):
        q_i = q[None, rows]
        o, lse = flash_attn_with_lse(q_i, k[None, rows], v[None, rows], scale, True)
        if prefix > segment:
            o = o.float()
        for first in range(0, prefix, segment):
            k_pre, v_pre = _prefix_rows(i, prefix, first, min(prefix, first + segment), k_cache, v_cache,
                                        block_tables, prefixes, k.dtype, kv_scales)
            o_pre, lse_pre = flash_attn_with_lse(q_i, k_pre[None], v_pre[None], scale, False)
            o, lse = merge_attention_outputs(o, lse, o_pre, lse_pre)
        out[rows] = o[0]
    return out


def _use_varlen(q: torch.Tensor, seqlens_q: list[int], seqlens_k: list[int], window: int | None,
                segment: int) -> bool:
    """Several short sequences in fp16/bf16 on CUDA whose prefixes together fit one segment
    (``segment`` tokens: varlen packs whole contexts), or with a sliding window any (the one fused
    kernel with a window): each per-sequence step costs host time, while varlen FlashAttention-2
    runs at a fraction of cuDNN's rate, so many short sequences go through varlen and few long
    ones through cuDNN (docs/ops.md, 'prefill_attention.py')."""
    lengths = [n for n in seqlens_q if n]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and (q.dtype, q.shape[2]) not in _varlen_failed
            and lengths):
        return False
    prefixes = sum(len_k - len_q for len_q, len_k in zip(seqlens_q, seqlens_k) if len_q)
    return window is not None or (len(lengths) > 1 and sum(lengths) <= _VARLEN_MAX_MEAN_TOKENS * len(lengths)
                                  and prefixes <= segment)


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
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor] | PrefixReader] | None = None,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`prefill_attention`: per sequence, one fp32 causal softmax over
    [prefix, new rows], with a window :func:`sliding_window_attention_ref` over [the prefix tokens
    it shows, new rows] (same arguments and result)."""
    prefixes = prefixes or {}
    kv_scales = _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes,
                                    sliding_window, k_scale, v_scale)
    if sliding_window is not None:
        return _prefill_window(q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes,
                               kv_scales, sliding_window, sliding_window_attention_ref)
    out = torch.empty_like(q)
    for i, rows, prefix in _sequences(seqlens_q, seqlens_k):
        keys, values = k[rows], v[rows]
        if prefix:
            k_pre, v_pre = _prefix_rows(i, prefix, 0, prefix, k_cache, v_cache, block_tables, prefixes, k.dtype,
                                        kv_scales)
            keys, values = torch.cat([k_pre, keys]), torch.cat([v_pre, values])
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
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor] | PrefixReader] | None = None,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length causal prefill attention, optionally in a sliding window.

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
            the prefix of sequence i, already gathered, instead of the cache's; with a window,
            possibly only its last rows (at least those the window shows: ``min(prefix,
            sliding_window - 1)``). Or ``{i: reader}``, a :data:`PrefixReader` called for the
            token ranges attended (e.g. gathering them from two KV tiers).
        sliding_window: None, or each query at position p attends only to the keys at
            ``p - sliding_window + 1 .. p`` (an int >= 1): only the prefix tokens some query of a
            chunk sees are gathered (from ``window_start(prefix, sliding_window)`` on) and the
            key blocks before them are never read.
        k_scale, v_scale: float32 ``[num_blocks, block_size, Hkv]``, exactly when the caches are
            fp8: the prefix gathered from the cache is dequantized (``nanovllm.ops.kv_quant``) to
            q's dtype; the new rows are the unquantized k, v (they were quantized as stored).

    Returns:
        ``[Nq, Hq, D]`` in q.dtype; query j of sequence i sits at position
        ``seqlens_k[i] - seqlens_q[i] + j`` and sees keys up to it (causal; with a window, the
        last ``sliding_window`` of them).

    Raises:
        ValueError: inconsistent shapes or lengths, a prefix without cache/block tables, a
            block table too short for a prefixed context, or a given prefix of the wrong shape
            (messages give the value and the limit); scales missing for fp8 caches or given for others.

    CUDA, several sequences of at most 1024 new tokens on average in fp16/bf16 whose prefixes
    together fit one segment (:func:`segment_tokens`): one varlen FlashAttention-2 launch
    (``torch.ops.aten._flash_attention_forward``, GQA native, bottom-right causal) over packed keys:
    the new k/v rows, or for a sequence with a prefix its whole context gathered from the cache.
    Otherwise (or if that kernel raises), per sequence: the new rows attend causally to themselves
    and non-causally to the prefix, gathered and attended one segment at a time (so memory does
    not grow with the context), each through :func:`flash_attn_with_lse` (cuDNN), merged by LSE
    with :func:`merge_attention_outputs`. Host lists mean no device sync on either path.
    CPU: the per-sequence path over torch's fused CPU attention (:func:`prefill_attention_ref`
    is the plain-math reference). With a window: fp16/bf16 on CUDA one varlen FlashAttention-2
    launch with its window over the packed chunks and the prefix tokens they see; otherwise per
    sequence :func:`sliding_window_attention` (query tiles over the keys they see).
    """
    prefixes = prefixes or {}
    kv_scales = _check_prefill_args(q, k, v, seqlens_q, seqlens_k, k_cache, v_cache, block_tables, prefixes,
                                    sliding_window, k_scale, v_scale)
    args = (q, k, v, seqlens_q, seqlens_k, scale, k_cache, v_cache, block_tables, prefixes, kv_scales)
    segment = segment_tokens(k, None if k_cache is None else k_cache.shape[1])
    if _use_varlen(q, seqlens_q, seqlens_k, sliding_window, segment):
        try:
            return _prefill_varlen(*args, sliding_window)
        except RuntimeError as err:
            _varlen_failed.add((q.dtype, q.shape[2]))
            logger.warning("varlen FlashAttention-2 unavailable for %s head_dim %d: %s", q.dtype, q.shape[2], err)
    if sliding_window is not None:
        return _prefill_window(*args, sliding_window)
    return _prefill_per_sequence(*args, segment)
