"""The decode reuse cache: host-tier blocks that a choosing policy (QUEST) selected in recent decode
steps, kept on the GPU so that a block selected again is read in place instead of loaded again.

Consecutive decode steps of a sequence tend to select many of the same blocks. Per layer the cache
keeps up to ``num_rows`` host blocks (that layer's keys and values of each), least recently
selected evicted first. Its rows are extra blocks of the GPU-tier tensor (block ids
``first_row .. first_row + num_rows - 1`` of every layer, after the blocks the block manager owns),
so the paged decode kernel reads cached blocks together with GPU-tier blocks in one call. The
cache only decides where blocks go; the pipeline copies and reads them (``pipeline.py``).

- A block is looked up by host-block id; host blocks are immutable until a spill rewrites them,
  so :meth:`ReuseCache.forget` drops the spilled-to ids (the one place a host block changes).
- A row is rewritten only for a block selected at the same layer, after the host read that
  layer's picks back, which the compute stream produced after every earlier read of the row: no
  event is needed against earlier readers.
- Within a (layer, step) no row read by that step is evicted; when every row is taken by blocks of
  the current step, further blocks are not placed (the pipeline reads them through the ring).
"""
from collections import OrderedDict


def reuse_cache_rows(config) -> int:
    """Rows per layer of the reuse cache of a cache with a host tier and a policy that chooses
    decode blocks (``KVCache`` decides whether it has one): ``config.num_reuse_cache_blocks``, by
    default (-1) ``config.sparse_topk_blocks`` (one step's picks of a sequence)."""
    return config.sparse_topk_blocks if config.num_reuse_cache_blocks == -1 else config.num_reuse_cache_blocks


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
        self._free = [list(range(first_row + num_rows - 1, first_row - 1, -1)) for _ in range(num_layers)]

    def place(self, layer: int, host_ids: list[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Rows for the host blocks that ``layer`` reads in this step (distinct ids, in order).

        Returns:
            ``(rows, loads)``: ``rows[h]`` is the GPU-tier block id block ``h`` is read from (absent
            for blocks that found no row); ``loads`` lists the ``(h, row)`` not in the cache, which
            must be loaded before the read. ``len(rows) - len(loads)`` blocks were found (reused).
        """
        entries, free = self._entries[layer], self._free[layer]
        rows, loads = {}, []
        for host_id in host_ids:
            row = entries.get(host_id)
            if row is not None:
                entries.move_to_end(host_id)
            elif free:
                row = free.pop()
            elif next(iter(entries)) not in rows:  # the least recently read entry is not read now
                row = entries.popitem(last=False)[1]
            else:  # every row holds a block of this step
                continue
            if host_id not in entries:
                entries[host_id] = row
                loads.append((host_id, row))
            rows[host_id] = row
        return rows, loads

    def forget(self, host_ids: list[int]) -> None:
        """Host blocks ``host_ids`` are being rewritten: drop their copies in every layer."""
        for entries, free in zip(self._entries, self._free):
            for host_id in host_ids:
                row = entries.pop(host_id, None)
                if row is not None:
                    free.append(row)

    def cached(self, layer: int) -> dict[int, int]:
        """``{host block: row}`` of ``layer``, least recently read first (a copy)."""
        return dict(self._entries[layer])
