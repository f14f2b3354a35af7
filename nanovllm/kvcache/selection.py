"""What a decode step reads when the sparse policy chooses blocks per layer (QUEST).

Each sequence's blocks split into *fixed* blocks, read whatever the query (the policy's
:meth:`~nanovllm.sparse.SparsePolicy.fixed_decode_blocks` and always the block being written;
every block of a sequence the policy does not select for), and *candidates*, among which the
policy picks per layer with that layer's query. Per step, :meth:`DecodeSelection.build` lists
both, and the fixed host-tier blocks that every layer loads (known before any query exists, so
the ring starts them a layer ahead). Per layer, once the picks are back on the host,
:meth:`DecodeSelection.layer_reads` says where each read block comes from:

- GPU-tier blocks, and picked host blocks found in or placed into the reuse cache: one paged
  table per sequence, in logical block order, the block being written last;
- fixed host blocks, and picked host blocks the reuse cache has no row for: the ring.

:class:`PickReader` brings a layer's picks to the host: a non-blocking copy into pinned memory and
an event, waited for alone (no stream synchronisation).
"""
from dataclasses import dataclass

import torch

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.reuse import ReuseCache
from nanovllm.sparse import DecodeBlocks, SparsePolicy
from nanovllm.utils.tensors import padded_rows, to_device


class _Row:
    """One sequence of the decode batch: its block tables, its fixed blocks (increasing), its
    index among the choosing sequences (-1: it reads every block), and the unwritten tokens of its
    last block."""

    __slots__ = ("gpu_table", "host_table", "fixed", "fixed_set", "choosing", "free_tokens")

    def __init__(self, gpu_table: list[int], host_table: list[int], length: int, fixed: list[int], choosing: int,
                 block_size: int):
        self.gpu_table, self.host_table, self.fixed, self.choosing = gpu_table, host_table, fixed, choosing
        self.fixed_set = set(fixed)
        self.free_tokens = len(gpu_table) * block_size - length


@dataclass
class LayerReads:
    """Where one layer of a decode step reads its blocks.

    Attributes:
        tables, lens: per sequence, the GPU-tier block ids (GPU-tier blocks and reuse-cache rows)
            in logical order and the tokens they hold (the paged decode kernel's block table and
            context length).
        cache_loads: ``(host block, reuse-cache row)`` to load before the paged read.
        ring_loads: ``(batch row, host block)`` read through the ring, after the fixed ones.
        reused, selected: distinct host blocks picked by the query found in the reuse cache, and
            picked in all.
    """

    tables: list[list[int]]
    lens: list[int]
    cache_loads: list[tuple[int, int]]
    ring_loads: list[tuple[int, int]]
    reused: int
    selected: int

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``(block tables [B, W] (-1 padded), context lengths [B])`` on ``device``, in
        one host-to-device copy."""
        width = max(map(len, self.tables))
        flat = to_device([b for row in padded_rows(self.tables, width) for b in row] + self.lens, torch.int32, device)
        return flat[:len(self.lens) * width].view(len(self.lens), width), flat[len(self.lens) * width:]


class DecodeSelection:
    """The choosing part of one decode step (see the module doc); built by :meth:`build`.

    Attributes:
        blocks: the candidates of the choosing sequences (``nanovllm.sparse.DecodeBlocks``).
        fixed_loads: ``(batch row, host block)`` every layer reads whatever the query, in order.
    """

    def __init__(self, rows: list[_Row], blocks: DecodeBlocks, query_rows: torch.Tensor | None, block_size: int):
        self.rows, self.blocks, self.query_rows, self.block_size = rows, blocks, query_rows, block_size
        self.fixed_loads = [(r, row.host_table[j]) for r, row in enumerate(rows) for j in row.fixed
                            if row.gpu_table[j] == NO_BLOCK]

    @classmethod
    def build(cls, policy: SparsePolicy, tables: list[tuple[list[int], list[int], int]], num_gpu_blocks: int,
              block_size: int, device: torch.device) -> "DecodeSelection | None":
        """The step's selection, or None when the policy selects for no sequence.

        Args:
            tables: per sequence of the batch, ``(GPU-tier table, host-tier table, length)``.
            num_gpu_blocks: GPU-tier blocks (host block ``h`` has metadata slot
                ``num_gpu_blocks + h``).
        """
        if not policy.chooses_decode_blocks:
            return None
        rows, choosing = [], []
        for gpu_table, host_table, length in tables:
            n = len(gpu_table)
            if gpu_table[-1] == NO_BLOCK:
                raise RuntimeError(f"the block a decode step writes (block {n - 1}) must be in the GPU tier, "
                                   f"found host block {host_table[-1]}")
            selects = policy.selects(n)
            fixed = sorted(set(policy.fixed_decode_blocks(n)) | {n - 1}) if selects else list(range(n))
            rows.append(_Row(gpu_table, host_table, length, fixed, len(choosing) if selects else -1, block_size))
            if selects:
                choosing.append(len(rows) - 1)
        if not choosing:
            return None
        width = max(len(rows[r].gpu_table) for r in choosing)
        slots = []
        for r in choosing:
            row = rows[r]
            slots.append([NO_BLOCK if j in row.fixed_set else g if g != NO_BLOCK else num_gpu_blocks + h
                          for j, (g, h) in enumerate(zip(row.gpu_table, row.host_table))])
        blocks = DecodeBlocks(choosing, [len(rows[r].gpu_table) for r in choosing],
                              to_device(padded_rows(slots, width), torch.int64, device))
        query_rows = None if len(choosing) == len(rows) else to_device(choosing, torch.int64, device)
        return cls(rows, blocks, query_rows, block_size)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The decode queries ``[S, Hq, D]`` of the choosing sequences, from the batch's ``q``."""
        return q if self.query_rows is None else q[self.query_rows]

    def layer_reads(self, picks: list[list[int]], reuse: ReuseCache | None, layer: int) -> LayerReads:
        """Where ``layer`` reads each block, given the policy's picks (per choosing sequence, its
        picked candidates, -1 entries ignored); places picked host blocks in ``reuse``."""
        picked = [[j for j in picks[row.choosing] if j >= 0] if row.choosing >= 0 else [] for row in self.rows]
        picked_host = list(dict.fromkeys(row.host_table[j] for row, js in zip(self.rows, picked) for j in js
                                         if row.gpu_table[j] == NO_BLOCK))
        rows_of, cache_loads = reuse.place(layer, picked_host) if reuse is not None and picked_host else ({}, [])
        tables, lens, ring_loads = [], [], []
        for r, (row, js) in enumerate(zip(self.rows, picked)):
            table = []
            for j in sorted(row.fixed + js) if js else row.fixed:
                if row.gpu_table[j] != NO_BLOCK:
                    table.append(row.gpu_table[j])
                elif j in row.fixed_set:  # a fixed host block: the ring's plan reads it
                    continue
                elif row.host_table[j] in rows_of:
                    table.append(rows_of[row.host_table[j]])
                else:
                    ring_loads.append((r, row.host_table[j]))
            tables.append(table)
            # every listed block is full but the last, the block being written (always on the GPU)
            lens.append(len(table) * self.block_size - row.free_tokens)
        return LayerReads(tables, lens, cache_loads, ring_loads, len(rows_of) - len(cache_loads), len(picked_host))


class PickReader:
    """Brings a device tensor of picks to the host: on CUDA a non-blocking copy into a pinned
    buffer (reused across layers: each layer's picks are read before the next layer's are
    computed) and an event that the host waits for, so only the work up to the picks is waited
    for. On CPU the picks are already there."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._ready = None

    def read(self, picks: torch.Tensor) -> list[list[int]]:
        """``picks`` (int64 ``[S, k]``) as nested lists, once the device computed them."""
        if not picks.is_cuda:
            return picks.tolist()
        if self._buffer is None or self._buffer.numel() < picks.numel():
            self._buffer = torch.empty(max(picks.numel(), 256), dtype=picks.dtype, pin_memory=True)
            self._ready = torch.cuda.Event()
        host = self._buffer[:picks.numel()].view(picks.shape)
        host.copy_(picks, non_blocking=True)
        self._ready.record()
        self._ready.synchronize()
        return host.tolist()
