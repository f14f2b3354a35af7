"""The decode reuse cache: host-tier pages that a choosing policy read in recent decode steps, kept
per (layer, KV head) in *cells* of GPU rows (``tier_rows.py``), so that a page read again is read in
place instead of gathered from the host again.

Consecutive decode steps of a sequence tend to read many of the same pages. Each layer owns
``num_rows`` rows of the GPU tier (blocks of ``pages_per_block`` pages); each (row page, KV head)
is a cell, so a KV head has ``num_rows * pages_per_block`` cells per layer and keeps its own
pages in them. The bookkeeping lives on the device, beside the picks, and never waits for the
host. Per layer and step (:meth:`ReuseCache.place`, torch ops, no host sync, no value of the
step read on the host, so that CUDA graphs capture it):

- a host page a head reads that one of its cells holds is a *hit*: read in place, its cell
  becomes the most recently used;
- the other reads (*misses*) are numbered per head in (sequence, read) order; miss ``n`` goes to
  the head's ``n``-th least recently used cell among those no read of this step used (its page
  is gathered there and the cell now holds it), and past the free cells to a staging page
  (``staging_page + n - free``: never cached).

A cell is rewritten only by a gather of its own layer on the compute stream, after every earlier
reader of it on that stream: no event is needed. Host pages are immutable until a spill rewrites
their block, so :meth:`ReuseCache.forget` drops the cells holding pages of rewritten host blocks.
"""
import torch

from nanovllm.sparse import policy_class
from nanovllm.utils.ints import cdiv

DEFAULT_ROWS_PER_PICK = 2
"""Default reuse-cache cells per KV head and layer for each page one sequence picks per step: a
step's misses take cells no read of the same step used, so with one cell per pick a step that hit
or filled every cell would leave the next no free cell (``docs/kvcache.md``, "Why two rows per
pick")."""


def reuse_cache_rows(config) -> int:
    """GPU blocks per layer of the reuse cache of a cache with a host tier and a policy that chooses
    decode pages (``KVCache`` decides whether it has one): ``config.num_reuse_cache_blocks``, by
    default (-1) the blocks whose pages give each KV head :data:`DEFAULT_ROWS_PER_PICK` cells per
    page the policy picks for a sequence (:meth:`~nanovllm.sparse.SparsePolicy.decode_pick_limit`)."""
    if config.num_reuse_cache_blocks == -1:
        picks = policy_class(config.sparse_policy).decode_pick_limit(config)
        return cdiv(DEFAULT_ROWS_PER_PICK * picks, config.kvcache_block_size)
    return config.num_reuse_cache_blocks


class ReuseCache:
    """Args: num_layers; num_kv_heads; num_rows (rows per layer, >= 1); first_row (the row of
    reuse row 0 within a layer's rows: the GPU tier's block count); layer_rows (rows per layer of
    the GPU tier's table, ``TierRows.layer_rows``); pages_per_block; device.

    Raises:
        ValueError: num_rows < 1.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_rows: int, first_row: int, layer_rows: int,
                 pages_per_block: int, device: torch.device):
        if num_rows < 1:
            raise ValueError(f"a reuse cache needs at least 1 row per layer, got {num_rows}")
        self.num_cells = num_rows * pages_per_block
        self.pages_per_block = pages_per_block
        shape = (num_layers, num_kv_heads, self.num_cells)
        self.held = torch.full(shape, -1, dtype=torch.int64, device=device)
        """The host page each cell holds, -1: none."""
        self.stamp = torch.full(shape, -1, dtype=torch.int64, device=device)
        """The step that last read each cell."""
        cells = torch.arange(self.num_cells, device=device)
        self._first_page = [(layer * layer_rows + first_row) * pages_per_block for layer in range(num_layers)]
        self._cells = cells
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        """The decode step, a device count (a replayed CUDA graph reads it as it is then)."""

    def begin_step(self) -> None:
        """A decode step starts: reads from now on count as this step's."""
        self.step.add_(1)

    def cell_pages(self, layer: int) -> torch.Tensor:
        """int64 ``[cells]``: the page id of each of ``layer``'s cells in the GPU tier's table of rows
        viewed as pages."""
        return self._first_page[layer] + self._cells

    def place(self, layer: int, host: torch.Tensor, staging_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each host page read at ``layer`` is read (module doc), updating the cache.

        Args:
            host: int64 ``[Hkv, N]``: per KV head, the host pages it reads (-1: not a host read),
                in (sequence, read) order.
            staging_page: the page id of the first staging page the misses may use.

        Returns:
            ``(pages, miss)``: int64 ``[Hkv, N]`` the page each read is read from (-1 where ``host``
            is -1) and bool ``[Hkv, N]`` the reads to gather into their page first.
        """
        held, stamp = self.held[layer], self.stamp[layer]
        is_read = host >= 0
        if not self.num_cells:  # no cells: every read is a miss, gathered into staging pages
            return self._staging(is_read, staging_page, 0), is_read
        sorted_held, order = held.sort(dim=1)
        pos = torch.searchsorted(sorted_held, host).clamp_(max=self.num_cells - 1)
        hit = is_read & (sorted_held.gather(1, pos) == host)
        hit_cell = order.gather(1, pos)
        used = torch.zeros(held.shape[0], self.num_cells + 1, dtype=torch.bool, device=host.device)
        used.scatter_(1, torch.where(hit, hit_cell, self.num_cells), True)
        used = used[:, :-1] | (stamp == self.step)  # read this step, here or by an earlier group
        free = (~used).sum(1, keepdim=True)
        victims = torch.where(used, torch.iinfo(torch.int64).max, stamp).argsort(dim=1, stable=True)
        miss = is_read & ~hit
        number = miss.long().cumsum(1) - 1
        victim = victims.gather(1, number.clamp(0, self.num_cells - 1))
        cached = miss & (number < free)
        cell = torch.where(hit, hit_cell, victim)
        pages = torch.where(hit | cached, self.cell_pages(layer)[cell], self._staging(miss, staging_page, free))
        touched = torch.where(hit | cached, cell, self.num_cells)
        for table, values in ((held, torch.where(cached, host, -1)), (stamp, None)):
            padded = torch.cat([table, table.new_zeros(table.shape[0], 1)], dim=1)
            if values is None:
                padded.scatter_(1, touched, self.step.expand(touched.shape))
            else:
                padded.scatter_(1, torch.where(cached, cell, self.num_cells), values)
            table.copy_(padded[:, :-1])
        pages = pages.masked_fill(~is_read, -1)
        return pages, miss

    @staticmethod
    def _staging(miss: torch.Tensor, staging_page: int, free) -> torch.Tensor:
        """The staging page of each miss: ``staging_page + n - free`` for the head's ``n``-th miss."""
        return staging_page + miss.long().cumsum(1) - 1 - free

    def forget(self, host_blocks: torch.Tensor) -> None:
        """Host blocks ``host_blocks`` (int64 ``[n]``, on the cache's device) are being rewritten: the
        cells holding their pages hold nothing now."""
        gone = torch.isin(self.held // self.pages_per_block, host_blocks) & (self.held >= 0)
        self.held.masked_fill_(gone, -1)
