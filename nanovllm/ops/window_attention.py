"""Sliding-window causal attention: each query attends to the last ``window`` keys up to itself.

A query at position ``p`` sees the keys at positions ``p - window + 1 .. p`` (Mistral's sliding
window; transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - window``). The queries are the
last ``Sq`` of the ``Sk`` keys (bottom-right aligned, as :func:`flash_attn_with_lse`'s causal
mask), so query ``i`` sits at key ``Sk - Sq + i``. Prefill uses it over a chunk and the part of its
cached prefix that the window shows (:func:`nanovllm.ops.prefill_attention`).
"""

import torch
import torch.nn.functional as F

from nanovllm.utils.ints import cdiv

from ._triton import check_gqa, check_head_dim
from .store_kv import gather_kvcache

_MIN_TILE = 256
"""Query rows per tile of the masked path at least (a tile's keys: its rows and the window before)."""


def check_window(window) -> int:
    """``window`` as an int >= 1; ValueError naming it otherwise."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be an int >= 1, got {window!r}")
    return window


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` attends to (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)


def gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int,
                  scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``start .. end - 1`` of one sequence from the paged cache ``[num_blocks, block_size,
    Hkv, D]`` (``block_table``: its block ids in order); only the blocks holding them are read.
    ``scale``, ``dtype``: as :func:`~nanovllm.ops.store_kv.gather_kvcache` (an fp8 cache's rows
    dequantized to ``dtype``)."""
    first = start // cache.shape[1]
    return gather_kvcache(cache, block_table[first:], end - first * cache.shape[1], scale,
                          dtype)[start - first * cache.shape[1]:]


def _check(q, k, v, window) -> int:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [Sq, Hq, D] and k, v [Sk, Hkv, D] with one D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] > k.shape[0]:
        raise ValueError(f"the {q.shape[0]} queries must be the last of the {k.shape[0]} keys")
    check_gqa(q.shape[1], k.shape[1])
    check_head_dim(q.shape[2])
    return check_window(window)


def band_mask(rows: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """bool ``[len(rows), num_keys]``: key j visible to the query at key position ``rows[i]``."""
    keys = torch.arange(num_keys, device=rows.device)
    return (keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - window)


def sliding_window_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 window: int) -> torch.Tensor:
    """Reference of :func:`sliding_window_attention` (same arguments and result): dense scores in
    float32 (float64 inputs: float64), -inf outside the band."""
    window = _check(q, k, v, window)
    seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[0], k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dtype).reshape(seq_q, heads_kv, heads_q // heads_kv, dim).permute(1, 2, 0, 3)
    kf, vf = (t.to(dtype).permute(1, 0, 2).unsqueeze(1) for t in (k, v))
    scores = (qf @ kf.transpose(-1, -2)) * scale
    rows = torch.arange(seq_q, device=q.device) + (seq_k - seq_q)
    scores = scores.masked_fill(~band_mask(rows, seq_k, window), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.permute(2, 0, 1, 3).reshape(seq_q, heads_q, dim).to(q.dtype)


def flash_window(q, k, v, cu_q, cu_k, max_q, max_k, scale, window) -> torch.Tensor:
    """torch's varlen FlashAttention-2 with a causal sliding window (bottom-right aligned per
    sequence): packed q ``[Nq, Hq, D]``, k, v ``[Nk, Hkv, D]`` (fp16/bf16, CUDA), int32 cumulative
    lengths. Raises RuntimeError where the kernel is unavailable."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
                                                   window_size_left=window - 1, window_size_right=0)[0]


def _masked_tiles(q, k, v, scale, window) -> torch.Tensor:
    """Query tiles of at least ``max(window, 256)`` rows, each over the keys its rows can see (its
    own and the ``window - 1`` before its first), through torch's SDPA with the band as a mask."""
    seq_q, seq_k = q.shape[0], k.shape[0]
    offset, tile = seq_k - seq_q, max(window, _MIN_TILE)
    out = torch.empty_like(q)
    for t0 in range(0, seq_q, tile):
        t1 = min(seq_q, t0 + tile)
        k0, k1 = max(0, offset + t0 - window + 1), offset + t1
        mask = band_mask(torch.arange(offset + t0, offset + t1, device=q.device) - k0, k1 - k0, window)
        out[t0:t1] = F.scaled_dot_product_attention(q[t0:t1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                    v[k0:k1].transpose(0, 1), attn_mask=mask, scale=scale,
                                                    enable_gqa=True).transpose(0, 1)
    return out


_flash_failed: set = set()
"""(dtype, head_dim) for which the windowed FlashAttention-2 raised once; not retried."""


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             window: int) -> torch.Tensor:
    """Causal sliding-window attention of the last ``Sq`` of ``Sk`` keys' queries.

    Args:
        q: ``[Sq, Hq, D]``; k, v: ``[Sk, Hkv, D]``, ``Sq <= Sk``, ``Hq % Hkv == 0`` (GQA: q head h
            uses kv head ``h // (Hq // Hkv)``), ``1 <= D <= 256``, float16/bfloat16/float32.
        scale: softmax scale (usually ``D ** -0.5``).
        window: tokens each query attends to, itself included (>= 1): query i (key position
            ``p = Sk - Sq + i``) sees keys ``max(0, p - window + 1) .. p``.

    Returns:
        ``[Sq, Hq, D]`` in q.dtype.

    Raises:
        ValueError: shapes that disagree, more queries than keys, Hq not a multiple of Hkv, D
            outside 1..256, window not an int >= 1.

    CUDA fp16/bf16: one launch of torch's FlashAttention-2 with its window (``window_size_left =
    window - 1``), which skips the key tiles outside the band. Otherwise (float32, CPU, or that
    kernel unavailable): query tiles of ``max(window, 256)`` rows, each through torch's SDPA over
    only the keys its rows can see, with the band as a boolean mask (work ``O(Sq (tile + window))``,
    not ``O(Sq Sk)``).
    """
    window = _check(q, k, v, window)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    key = (q.dtype, q.shape[2])
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and key not in _flash_failed:
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        try:
            return flash_window(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], scale, window)
        except RuntimeError:
            _flash_failed.add(key)
    return _masked_tiles(q, k, v, scale, window)


def visible_block_layout(n_q: int, n_k: int, block_size: int, seq_q: int, seq_k: int, window: int,
                         device) -> torch.Tensor:
    """bool ``[n_q, n_k]``: some query of query block qb (the last ``seq_q`` of ``seq_k`` keys,
    ``block_size`` rows a block) sees some key of key block kb under the causal sliding window."""
    offset = seq_k - seq_q
    q_first = offset + torch.arange(n_q, device=device) * block_size
    q_last = offset + torch.clamp((torch.arange(n_q, device=device) + 1) * block_size, max=seq_q) - 1
    k_first = torch.arange(n_k, device=device) * block_size
    k_last = k_first + block_size - 1
    return (k_first[None, :] <= q_last[:, None]) & (k_last[None, :] > q_first[:, None] - window)


def visible_blocks(seq_q: int, seq_k: int, block_size: int, window: int) -> int:
    """How many (query block, key block) pairs :func:`visible_block_layout` keeps."""
    return int(visible_block_layout(cdiv(seq_q, block_size), cdiv(seq_k, block_size), block_size, seq_q, seq_k,
                                    window, "cpu").sum())
