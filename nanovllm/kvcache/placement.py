"""Placement: which GPU-tier block goes to the host tier when the GPU tier is full.

The rule, coldest first: new KV is always written to the GPU tier; when a block is needed there
and none is free, the block manager spills the *spill candidate* that became full the longest ago
(a prefix-cache hit counts as becoming full again when a sequence takes it). Spill candidates are
the full blocks of live sequences, except each sequence's first block (the attention sink, read
by every query) - so the block being written, which is never full, is never spilled either.
Freed prefix-cached blocks are not candidates: the GPU tier reuses them before it spills.

The block manager tells the rule which blocks became candidates and which stopped being ones;
a later rule (e.g. keeping the blocks that sparse selection reads most) replaces this class.
"""
from collections import OrderedDict


class ColdestFirst:
    """Spill candidates in the order they became full (oldest first)."""

    def __init__(self):
        self._candidates: OrderedDict[int, int] = OrderedDict()  # GPU block id -> logical index

    def __len__(self) -> int:
        return len(self._candidates)

    def add(self, gpu_block: int, index: int) -> None:
        """GPU block ``gpu_block`` (logical index ``index`` of its sequences) became a candidate,
        or was touched again: it becomes the warmest."""
        self._candidates.pop(gpu_block, None)
        self._candidates[gpu_block] = index

    def remove(self, gpu_block: int) -> None:
        """``gpu_block`` was freed or spilled."""
        self._candidates.pop(gpu_block, None)

    def victim(self) -> tuple[int, int] | None:
        """``(gpu_block, logical index)`` of the coldest candidate, or None when there is none."""
        return next(iter(self._candidates.items()), None)
