"""The decode reuse cache: host-tier blocks that a choosing policy (QUEST) picked in recent decode
steps, kept in rows of the GPU tier (``tier_rows.py``) so that a block picked again is read in
place instead of gathered from the host again.

Consecutive decode steps of a sequence tend to pick many of the same blocks. Per layer the cache
keeps up to ``num_rows`` host blocks (that layer's keys and values of each) in rows of that layer.
The picks are made on the device and never wait for the host, so
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
  hits and placed blocks become the most recently used; a victim left unused keeps the block it
  held (its row was not written), back as the least recently used entry, or becomes free.

A step that launched nothing (its plan failed) gives its victims back with
:meth:`ReuseCache.abort_step`; a layer that a failing step did not finish frees them
(:meth:`ReuseCache.release`: some may have been written). A step begins only after every layer of
the previous one was recorded or released (RuntimeError otherwise), so that no row is both a
victim and mapped.

A row is rewritten only by a gather of its own layer on the compute stream, after every earlier
reader of it on that stream: no event is needed. Host blocks are immutable until a spill rewrites
them, so :meth:`ReuseCache.forget` drops the spilled-to ids (the one place a host block changes;
the cache first records the pending step, so blocks it placed are forgotten too).
"""
from collections import OrderedDict

from nanovllm.sparse import policy_class


DEFAULT_ROWS_PER_PICK = 2
"""Default reuse-cache rows per layer for each of a sequence's decode picks (``sparse_topk_blocks``).

A step's victims exclude the rows that the last recorded step found or placed. With one row per
pick, a step that found or placed a block in every row leaves no victim for the next one, whose
misses then go to staging rows uncached: a newly picked block is cached a step late, and the cache
admits blocks only every other step while the picks drift. Two rows per pick leave room
(reuse rates with one and two rows: docs/kvcache.md, 'Why two rows per pick')."""


def reuse_cache_rows(config) -> int:
    """Rows per layer of the reuse cache of a cache with a host tier and a policy that chooses
    decode blocks (``KVCache`` decides whether it has one): ``config.num_reuse_cache_blocks``, by
    default (-1) :data:`DEFAULT_ROWS_PER_PICK` x the policy's most picks per sequence and layer
    (:meth:`~nanovllm.sparse.SparsePolicy.decode_pick_limit`)."""
    if config.num_reuse_cache_blocks == -1:
        return DEFAULT_ROWS_PER_PICK * policy_class(config.sparse_policy).decode_pick_limit(config)
    return config.num_reuse_cache_blocks


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
        self._evicted: list[dict[int, int]] = [{} for _ in range(num_layers)]
        """Per layer, ``{victim row: host block it held}`` until the step is recorded."""

    def begin_step(self, max_misses: int) -> list[list[int]]:
        """Per layer, the victim rows (GPU-tier block ids) of a step that misses at most
        ``max_misses`` blocks per layer; their entries leave the cache until :meth:`record`.

        Raises:
            RuntimeError: the previous step was neither recorded nor aborted.
        """
        if any(self._victims):
            raise RuntimeError("ReuseCache.begin_step: the previous step's victims were not recorded "
                               "(record each layer or abort_step first)")
        for layer, entries in enumerate(self._entries):
            free, used, evicted = self._free[layer], self._used[layer], self._evicted[layer]
            victims = free[:max_misses]
            del free[:len(victims)]
            for host_id in [h for h, row in entries.items() if row not in used][:max_misses - len(victims)]:
                row = entries.pop(host_id)
                evicted[row] = host_id
                victims.append(row)
            self._victims[layer] = victims
        return [list(v) for v in self._victims]

    def abort_step(self) -> None:
        """The step that :meth:`begin_step` began launched nothing: every layer keeps what it
        held."""
        for layer in range(len(self._entries)):
            self.record(layer, [], [])

    def release(self, layer: int) -> None:
        """The step stopped at ``layer`` with its picks unknown (some of its gathers may have run):
        the layer's victims become free, the blocks they held forgotten."""
        self._free[layer] += self._victims[layer]
        self._victims[layer] = []
        self._evicted[layer].clear()
        self._used[layer] = set()

    def cached(self, layer: int) -> dict[int, int]:
        """``{host block: row}`` of ``layer``, least recently used first (a copy)."""
        return dict(self._entries[layer])

    def record(self, layer: int, hits: list[int], placed: list[tuple[int, int]]) -> None:
        """The outcome of the step at ``layer``: the host blocks found (``hits``) and ``(host
        block, victim row)`` of the misses placed, in the order they were read. A victim not
        placed still holds its block (unless that block was placed again in another row): it
        returns as the least recently used entry, or becomes free."""
        entries, evicted = self._entries[layer], self._evicted[layer]
        for host_id in hits:
            entries.move_to_end(host_id)
        filled = set()
        for host_id, row in placed:
            filled.discard(entries.pop(host_id, None))  # picked by two sequences: the later copy is kept
            entries[host_id] = row
            filled.add(row)
        for row in self._victims[layer]:
            if row in filled:
                continue
            host_id = evicted.get(row)
            if host_id is None or host_id in entries:
                self._free[layer].append(row)
            else:
                entries[host_id] = row
                entries.move_to_end(host_id, last=False)
        evicted.clear()
        self._victims[layer] = []
        self._used[layer] = filled | {entries[h] for h in hits}

    def forget(self, host_ids: list[int]) -> None:
        """Host blocks ``host_ids`` are being rewritten: drop their copies in every layer (also
        those held by the victims of a step not yet recorded)."""
        gone = set(host_ids)
        for entries, free, evicted in zip(self._entries, self._free, self._evicted):
            for host_id in host_ids:
                row = entries.pop(host_id, None)
                if row is not None:
                    free.append(row)
            for row in [r for r, h in evicted.items() if h in gone]:
                del evicted[row]
