"""The kept-block lists that the block-sparse attention kernel walks.

From a bool block mask ``[Hq, nQ, nK]`` two lists per (head, query block): the kept *full* key
blocks (inside the keys and, if causal, wholly at or before the query block's first row, and with a
sliding window wholly inside the window of its last row, so every key is visible to every row:
attended without masks) and the kept *partial* ones (crossing the causal diagonal, the window's
edge or the end of the keys: attended with masks). Each list is a count and the
ascending block indices, listed first in a row of nK int32 (entries past the count are
unspecified). CUDA: one Triton kernel, one program per (head, query block), prefix sums place
the indices (no sort, no host sync). CPU: :func:`kept_block_lists_ref`.
"""

from numbers import Integral
from typing import NamedTuple

import torch

from nanovllm.utils.ints import cdiv, is_pow2

from ._triton import check_causal, row_tile
from .backend import interpreted, tl, triton, use_triton


class BlockLists(NamedTuple):
    """int32 lists of kept key blocks per (head, query block): counts ``[Hq, nQ]``, indices
    ``[Hq, nQ, nK]`` (ascending, first ``count`` entries valid)."""

    full_count: torch.Tensor
    full_index: torch.Tensor
    count: torch.Tensor
    index: torch.Tensor


def full_layout(n_q: int, n_k: int, block_size: int, seq_q: int, seq_k: int, causal: bool, device,
                window: int | None = None) -> torch.Tensor:
    """bool ``[n_q, n_k]``: key block kb lies inside the keys and, if causal, its last key is at or
    before the position (``Sk - Sq + row``) of query block qb's first row and, with a sliding
    window, its first key inside the window of qb's last row, so every key of the block is visible
    to every row of the query block (rows past Sq are never stored)."""
    key_end = (torch.arange(n_k, device=device) + 1) * block_size
    inside = (key_end <= seq_k)[None, :]
    if not causal:
        return inside.expand(n_q, n_k)
    first_pos = seq_k - seq_q + torch.arange(n_q, device=device) * block_size
    full = inside & (key_end[None, :] - 1 <= first_pos[:, None])
    if window is not None:
        last_pos = seq_k - seq_q + torch.clamp((torch.arange(n_q, device=device) + 1) * block_size, max=seq_q) - 1
        full = full & (key_end[None, :] - block_size > last_pos[:, None] - window)
    return full


def window_layout(n_q: int, n_k: int, block_size: int, seq_q: int, seq_k: int, window: int, device) -> torch.Tensor:
    """bool ``[n_q, n_k]``: key block kb is not wholly before the sliding window of query block
    qb's first row (its last key ``> Sk - Sq + qb * block_size - window``)."""
    key_last = (torch.arange(n_k, device=device) + 1) * block_size - 1
    first_pos = seq_k - seq_q + torch.arange(n_q, device=device) * block_size
    return key_last[None, :] > first_pos[:, None] - window


def _listed(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, index) of a bool ``[..., nQ, nK]`` mask: kept indices first and ascending (the
    rest ascending after them)."""
    count = mask.sum(-1, dtype=torch.int32)
    index = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), index.contiguous()


def _check_args(mask, block_size, seq_q, seq_k, causal, window=None) -> tuple[int, int, int, bool]:
    """ValueError naming the argument, its value and the limit (see :func:`kept_block_lists`);
    returns ``(block_size, seq_q, seq_k, causal)`` as Python ints and bool."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 3:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor [Hq, nQ, nK]; got {got}")
    if not is_pow2(block_size) or not 16 <= block_size <= 1024:
        raise ValueError(f"block_size={block_size!r} must be a power of two in 16..1024")
    for name, seq in (("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(seq, bool) or not isinstance(seq, Integral) or seq < 0:
            raise ValueError(f"{name}={seq!r} must be a non-negative int")
    block_size, seq_q, seq_k = int(block_size), int(seq_q), int(seq_k)
    expected = (cdiv(seq_q, block_size), cdiv(seq_k, block_size))
    if tuple(mask.shape[1:]) != expected:
        raise ValueError(f"mask [Hq, nQ, nK] = {tuple(mask.shape)} must have nQ, nK = ceil(seq_q/{block_size}), "
                         f"ceil(seq_k/{block_size}) = {expected}")
    causal = check_causal(causal)
    if window is not None and (isinstance(window, bool) or not isinstance(window, Integral) or window < 1
                               or not causal):
        raise ValueError(f"window={window!r} must be None or an int >= 1 with causal=True")
    return block_size, seq_q, seq_k, causal


def kept_block_lists_ref(mask: torch.Tensor, block_size: int, seq_q: int, seq_k: int, causal: bool,
                         window: int | None = None) -> BlockLists:
    """Reference of :func:`kept_block_lists` (same arguments, results and errors):
    :func:`full_layout` (and :func:`window_layout`) and two stable argsorts."""
    block_size, seq_q, seq_k, causal = _check_args(mask, block_size, seq_q, seq_k, causal, window)
    shape = (mask.shape[1], mask.shape[2], block_size, seq_q, seq_k)
    if window is not None:
        mask = mask & window_layout(*shape, window, mask.device)
    full = mask & full_layout(*shape, causal, mask.device, window)
    return BlockLists(*_listed(full), *_listed(mask & ~full))


@triton.jit(do_not_specialize=["n_q", "n_k", "offset", "seq_k", "window", "stride_mh", "stride_mq", "stride_ch",
                                "stride_ih", "stride_iq"])
def _kept_block_lists_kernel(
    mask_ptr, full_count_ptr, full_index_ptr, count_ptr, index_ptr, n_q, n_k, offset, seq_k, window,
    stride_mh, stride_mq, stride_ch, stride_ih, stride_iq,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
):
    """Program (h, qb): the row ``mask[h, qb]``, split into full and partial kept blocks; an
    inclusive prefix sum gives each kept block its slot in its list. WINDOWED: blocks wholly before
    the window of qb's first row are dropped, those crossing the window of its last row partial."""
    h = tl.program_id(0) // n_q
    qb = tl.program_id(0) % n_q
    kb = tl.arange(0, BLOCK_K)
    kept = tl.load(mask_ptr + h * stride_mh + qb * stride_mq + kb, mask=kb < n_k, other=0) != 0
    last_key = (kb + 1) * BLOCK_SIZE - 1
    full = last_key < seq_k
    if CAUSAL:
        full = full & (last_key <= offset + qb * BLOCK_SIZE)
    if WINDOWED:
        kept = kept & (last_key > offset + qb * BLOCK_SIZE - window)
        last_row = offset + tl.minimum((qb + 1) * BLOCK_SIZE, seq_k - offset) - 1
        full = full & (kb * BLOCK_SIZE > last_row - window)
    kept_full = kept & full
    kept_partial = kept & (full == 0)
    full_slot = tl.cumsum(kept_full.to(tl.int32), 0) - 1
    partial_slot = tl.cumsum(kept_partial.to(tl.int32), 0) - 1
    rows = h * stride_ih + qb * stride_iq
    tl.store(full_index_ptr + rows + full_slot, kb, mask=kept_full)
    tl.store(index_ptr + rows + partial_slot, kb, mask=kept_partial)
    tl.store(full_count_ptr + h * stride_ch + qb, tl.sum(kept_full.to(tl.int32), 0))
    tl.store(count_ptr + h * stride_ch + qb, tl.sum(kept_partial.to(tl.int32), 0))


def kept_block_lists(mask: torch.Tensor, block_size: int, seq_q: int, seq_k: int, causal: bool,
                     window: int | None = None) -> BlockLists:
    """The full and partial kept-block lists of a block mask (module docstring).

    Args:
        mask: bool ``[Hq, nQ, nK]``, key block kb kept for query block qb of head h.
        block_size: tokens per block (query and key).
        seq_q, seq_k: query and key lengths; query row i sits at key position ``Sk - Sq + i``.
        causal: bottom-right aligned causal mask (decides which blocks are full).
        window: None, or a causal sliding window (tokens, >= 1; needs causal): key blocks wholly
            before the window of every row of a query block are dropped, those crossing the window
            of one of its rows are partial.

    Returns:
        :class:`BlockLists`: int32 counts ``[Hq, nQ]`` and indices ``[Hq, nQ, nK]`` on mask's
        device; the first ``count`` indices of a row ascending, the rest unspecified.

    Raises:
        ValueError: mask not a 3-D bool tensor, block_size not a power of two in 16..1024,
            seq_q/seq_k not non-negative ints, mask not ``ceil(seq / block_size)`` blocks long in
            either dim, causal not a bool, or window not None / an int >= 1 with causal.
    """
    block_size, seq_q, seq_k, causal = _check_args(mask, block_size, seq_q, seq_k, causal, window)
    if not use_triton(mask):
        return kept_block_lists_ref(mask, block_size, seq_q, seq_k, causal, window)
    heads, n_q, n_k = mask.shape
    mask = mask.contiguous().view(torch.uint8)
    full_count, count = (torch.empty((heads, n_q), dtype=torch.int32, device=mask.device) for _ in range(2))
    full_index, index = (torch.empty((heads, n_q, n_k), dtype=torch.int32, device=mask.device) for _ in range(2))
    _kept_block_lists_kernel[(heads * n_q,)](
        mask, full_count, full_index, count, index, n_q, n_k, seq_k - seq_q, seq_k, window or 0, mask.stride(0),
        mask.stride(1), count.stride(0), index.stride(0), index.stride(1),
        BLOCK_SIZE=block_size, BLOCK_K=row_tile(n_k, interpreted(mask)), CAUSAL=causal, WINDOWED=window is not None,
        num_warps=4,
    )
    return BlockLists(full_count, full_index, count, index)
