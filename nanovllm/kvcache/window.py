"""Sliding windows in the KV cache: which blocks a windowed layer reads, and which blocks a
sequence no longer needs.

A layer with window ``W`` (``LayerKVSpec.sliding_window``) lets the query at position ``p`` attend
to the keys at ``p - W + 1 .. p`` only. For a decode row of ``n`` tokens (query at ``n - 1``) the
first visible token is ``max(0, n - W)``: logical blocks before its block are neither read (GPU
tier) nor loaded (host tier); its block is read from that token on (``skip`` tokens masked, the
paged kernel's ``context_starts``; a host block folded from its ``skip``-th token). The rows of a
window are the same for every layer with that window, so a step builds them once per distinct
window (:func:`window_row`), beside the full-attention rows of layers without one.

Released blocks: once every layer of the model has a window (the widest ``W``), a block whose last
token is before ``window_start(c, W)`` (``c`` the position of a sequence's next query) is never
seen again by that sequence; the block manager releases it (``RELEASED`` in both tables).
"""
from dataclasses import dataclass

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.ops.window_attention import window_start

__all__ = ["WindowRow", "widest_window", "window_row", "window_start", "window_table_width"]


def widest_window(windows: list[int | None]) -> int | None:
    """The window every layer of ``windows`` (one entry per layer) respects: the widest, or None
    when some layer attends to every earlier key (or there are no layers)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def window_table_width(window: int | None, block_size: int, max_model_len: int) -> int:
    """The most blocks one decode row reads: every block of ``max_model_len`` tokens, or with a
    window the most blocks ``window`` consecutive tokens span (``(W + B - 2) // B + 1``)."""
    blocks = -(-max_model_len // block_size)
    return blocks if window is None else min(blocks, (window + block_size - 2) // block_size + 1)


@dataclass
class WindowRow:
    """One decode row's reads under one window (None: every block).

    Attributes:
        table: GPU-tier blocks read, in logical order (from the window's first block).
        length: tokens of ``table`` (the new one included), host blocks left out.
        start: tokens at the head of ``table`` before the window (masked, not read).
        loads: host blocks read, in logical order; skips: tokens of each before the window.
    """

    table: list[int]
    length: int
    start: int
    loads: list[int]
    skips: list[int]


def window_row(gpu_table: list[int], host_table: list[int], length: int, window: int | None, block_size: int,
               tiered: bool) -> WindowRow:
    """What a decode row of ``length`` tokens reads under ``window`` (module doc). Without a window
    and without host blocks: its whole GPU table; with host blocks (``tiered``), its GPU blocks
    compacted and its host blocks as loads (full blocks: each spilled block is full)."""
    first = window_start(length - 1, window)
    fb, skip = first // block_size, first % block_size
    end = len(gpu_table) if window is None else -(-length // block_size)
    gpu, n = gpu_table[fb:end], length - fb * block_size
    if not (tiered and NO_BLOCK in gpu):
        return WindowRow(gpu, n, skip, [], [])
    host = host_table[fb:end]
    loads = [h for h in host if h != NO_BLOCK]
    skips = [skip if j == 0 else 0 for j, h in enumerate(host) if h != NO_BLOCK]
    table = [b for b in gpu if b != NO_BLOCK]
    return WindowRow(table, n - len(loads) * block_size, skip if gpu[0] != NO_BLOCK else 0, loads, skips)
