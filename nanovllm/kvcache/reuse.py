"""The rows of the GPU tier that decode with a choosing policy (QUEST) reads picked host blocks
from: the reuse cache's rows (per layer) and the staging rows (shared by all layers).

**Layout** (:class:`TierRows`): decode with a choosing policy addresses the GPU tier of all layers
as one table of rows ``[L * layer_rows + staging_rows, block_size, Hkv, D]`` (keys, values): row
``layer * layer_rows + b`` is block ``b`` of ``layer`` (the block manager's blocks, then the reuse
cache's rows), the last ``staging_rows`` rows are the staging rows. So one paged read covers
GPU-tier blocks, reuse-cache rows and staging rows, and the staging rows exist once, not per layer.

**Reuse cache** (:class:`ReuseCache`): consecutive decode steps of a sequence tend to pick many of
the same blocks. Per layer the cache keeps up to ``num_rows`` host blocks (that layer's keys and
values of each) in rows of that layer, so a block picked again is read in place instead of
gathered from the host again. The picks are made on the device and never wait for the host, so
the cache's bookkeeping (on the host) lags a step:

- at a step's start (:meth:`ReuseCache.begin_step`) each layer gives up *victim* rows for the
  step's misses: free rows first, then rows holding a block that the last recorded step neither
  found nor placed, least recently used first, at most as many as the step can miss. Their
  entries leave the map the step uploads (:meth:`ReuseCache.cached`), so no hit of the step reads
  a row that a miss of the step overwrites;
- on the device, a picked host block found in the map is read from its row; the others (misses)
  are numbered in (sequence, pick) order and gathered into the victim rows, then into staging rows
  (never cached);
- after the step the picks come back to the host (one copy, one event); at the next step's start
  the host recomputes from them where each miss landed and records it (:meth:`ReuseCache.record`):
  hits and placed blocks become the most recently used, victims left unused become free.

A row is rewritten only by a gather of its own layer on the compute stream, after every earlier
reader of it on that stream: no event is needed. Host blocks are immutable until a spill rewrites
them, so :meth:`ReuseCache.forget` drops the spilled-to ids (the one place a host block changes;
the cache first records the pending step, so blocks it placed are forgotten too).
"""
from collections import OrderedDict
from typing import NamedTuple

STAGING_SEQS = 8
"""Sequences whose picks the staging rows hold at once: ``sparse_topk_blocks`` rows each."""


def reuse_cache_rows(config) -> int:
    """Rows per layer of the reuse cache of a cache with a host tier and a policy that chooses
    decode blocks (``KVCache`` decides whether it has one): ``config.num_reuse_cache_blocks``, by
    default (-1) ``config.sparse_topk_blocks`` (one step's picks of a sequence)."""
    return config.sparse_topk_blocks if config.num_reuse_cache_blocks == -1 else config.num_reuse_cache_blocks


def staging_rows(config) -> int:
    """Staging rows (shared by all layers) of a cache with a host tier and a policy that chooses
    decode blocks: ``sparse_topk_blocks`` per sequence for up to :data:`STAGING_SEQS` sequences
    (``max_num_seqs`` if fewer). One layer of one block each, so 8 sequences of top-k 4 cost 32
    layer blocks (512 MiB at Llama-3.1-8B's 4,096-token blocks, beside 64 GiB of its GPU tier). A
    step whose picks could miss more than the victim and staging rows hold reads its sequences in
    groups (``selection.py``)."""
    return config.sparse_topk_blocks * min(config.max_num_seqs, STAGING_SEQS)


class TierRows(NamedTuple):
    """The GPU tier as one table of rows (see the module doc): ``num_layers`` layers of
    ``layer_rows`` rows, then ``staging_rows`` rows shared by all layers."""

    num_layers: int
    layer_rows: int
    staging_rows: int

    @property
    def staging_base(self) -> int:
        """The row of staging row 0."""
        return self.num_layers * self.layer_rows

    @property
    def total(self) -> int:
        return self.staging_base + self.staging_rows

    def row(self, layer: int, block: int) -> int:
        """The row of GPU-tier block (or reuse-cache row) ``block`` of ``layer``."""
        return layer * self.layer_rows + block


class ReuseCache:
    """Args: num_layers; num_rows (rows per layer, >= 1); first_row (the GPU-tier block id of row 0).

    Raises:
        ValueError: num_rows < 1.
    """

    def __init__(self, num_layers: int, num_rows: int, first_row: int):
        if num_rows < 1:
            raise ValueError(f"a reuse cache needs at least 1 row per layer, got {num_rows}")
        self.num_rows, self.first_row = num_rows, first_row
        self._entries: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_layers)]
        self._free = [list(range(first_row, first_row + num_rows)) for _ in range(num_layers)]
        self._used: list[set[int]] = [set() for _ in range(num_layers)]
        self._victims: list[list[int]] = [[] for _ in range(num_layers)]

    def begin_step(self, max_misses: int) -> list[list[int]]:
        """Per layer, the victim rows (GPU-tier block ids) of a step that misses at most
        ``max_misses`` blocks per layer; their entries leave the cache until :meth:`record`."""
        for layer, entries in enumerate(self._entries):
            free, used = self._free[layer], self._used[layer]
            victims = free[:max_misses]
            del free[:len(victims)]
            for host_id in [h for h, row in entries.items() if row not in used][:max_misses - len(victims)]:
                victims.append(entries.pop(host_id))
            self._victims[layer] = victims
        return [list(v) for v in self._victims]

    def cached(self, layer: int) -> dict[int, int]:
        """``{host block: row}`` of ``layer``, least recently used first (a copy)."""
        return dict(self._entries[layer])

    def record(self, layer: int, hits: list[int], placed: list[tuple[int, int]]) -> None:
        """The outcome of the step at ``layer``: the host blocks found (``hits``) and ``(host
        block, victim row)`` of the misses placed, in the order they were read; the victims
        not placed become free."""
        entries = self._entries[layer]
        for host_id in hits:
            entries.move_to_end(host_id)
        filled = set()
        for host_id, row in placed:
            filled.discard(entries.pop(host_id, None))  # picked by two sequences: the later copy is kept
            entries[host_id] = row
            filled.add(row)
        self._free[layer] += [row for row in self._victims[layer] if row not in filled]
        self._victims[layer] = []
        self._used[layer] = filled | {entries[h] for h in hits}

    def forget(self, host_ids: list[int]) -> None:
        """Host blocks ``host_ids`` are being rewritten: drop their copies in every layer."""
        for entries, free in zip(self._entries, self._free):
            for host_id in host_ids:
                row = entries.pop(host_id, None)
                if row is not None:
                    free.append(row)
