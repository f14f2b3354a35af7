"""What a decode step reads when the sparse policy chooses blocks per layer (QUEST), decided on the
device: the picks never come back to the host within the step.

Each sequence's blocks split into *fixed* blocks, read whatever the query (the policy's
:meth:`~nanovllm.sparse.SparsePolicy.fixed_decode_blocks` and always the block being written;
every block of a sequence the policy does not select for), and *candidates*, among which the
policy picks per layer with that layer's query. At the step's start :meth:`DecodeSelection.build`
(host) lists both and uploads, per choosing sequence, where each block can be read in place at
each layer (GPU-tier block or reuse-cache row, ``[L, S, W]``), its host block, the fixed GPU-tier
blocks, the unwritten tokens of its last block, the victim rows of each layer (``reuse.py``) and
the tables of the sequences that do not choose. The fixed host-tier blocks are known then too: the
ring reads them, every layer's in one plan.

Per layer :meth:`DecodeSelection.layer_reads` turns the picks ``[S, k]`` into, in one launch
(:func:`nanovllm.ops.selected_reads`; no host sync, shapes fixed per step):

- the gather list: each picked host block not in the reuse cache (a *miss*; misses numbered in
  (sequence, pick) order) goes to the layer's next victim row, then to the next staging row;
- the paged decode kernel's block table per sequence: the fixed GPU-tier blocks and every picked
  block's row, in logical block order (-1 padded), and context length = read blocks x block_size
  - the last block's unwritten tokens.

A step whose misses could exceed the victim and staging rows is read in groups of sequences
(gather and attention per group), each group's misses numbered after the victims and the earlier
groups' misses, so that the staging rows are reused group after group.

After the step the picks of every layer come back to the host in one copy (:class:`StepPicks`);
at the next step's start :meth:`DecodeSelection.replay` recomputes with the kernel's reference
(:func:`nanovllm.ops.pick_rows`) where each miss landed, updates the reuse cache and counts the step's statistics.
"""
import torch
from torch.nn.utils.rnn import pad_sequence

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.reuse import ReuseCache
from nanovllm.kvcache.tier_rows import TierRows
from nanovllm.ops import pick_rows, selected_reads
from nanovllm.sparse import DecodeBlocks, SparsePolicy, SparseStats
from nanovllm.utils.tensors import padded_rows, to_device


class _Row:
    """One sequence of the decode batch: its block tables, its fixed blocks (increasing), its
    index among the choosing sequences (-1: it reads every block, all of them fixed), the most
    blocks the policy picks for it per layer (its ``max_decode_picks``; 0 when it does not choose)
    and the unwritten tokens of its last block."""

    __slots__ = ("gpu_table", "host_table", "fixed", "choosing", "max_picks", "free_tokens", "skip")

    def __init__(self, gpu_table: list[int], host_table: list[int], length: int, fixed: list[int], choosing: int,
                 max_picks: int, block_size: int, skip: int = 0):
        self.gpu_table, self.host_table, self.fixed, self.choosing = gpu_table, host_table, fixed, choosing
        self.max_picks, self.skip = max_picks, skip
        self.free_tokens = len(gpu_table) * block_size - length

    def num_reads(self) -> int:
        """Blocks this row reads per layer at most: its fixed blocks and its picks."""
        return len(self.fixed) + self.max_picks

    def num_fixed_gpu(self) -> int:
        """Fixed blocks read in place from the GPU tier."""
        return sum(self.gpu_table[j] != NO_BLOCK for j in self.fixed)

    def host_candidates(self) -> int:
        """Candidate blocks (not fixed) that only the host tier holds: the most this row can miss."""
        fixed = set(self.fixed)
        return sum(1 for j, g in enumerate(self.gpu_table) if g == NO_BLOCK and j not in fixed)


class StepPicks:
    """The picks of a step's layers, brought to the host after the step: on CUDA one non-blocking
    copy into a pinned buffer (reused across steps: a step's picks are read before the next step
    copies) and an event, waited for once; on CPU they are already there."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._ready = None

    def copy(self, picks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Start bringing ``picks`` (int64, one tensor per layer) to the host; returns their host
        tensors, valid once :meth:`wait` returned."""
        if not picks or not picks[0].is_cuda:
            return picks
        flat = torch.cat([p.flatten() for p in picks])
        if self._buffer is None or self._buffer.numel() < flat.numel():
            self._buffer = torch.empty(max(flat.numel(), 4096), dtype=flat.dtype, pin_memory=True)
            self._ready = torch.cuda.Event()
        host = self._buffer[:flat.numel()]
        host.copy_(flat, non_blocking=True)
        self._ready.record()
        return list(host.split([p.numel() for p in picks]))

    def wait(self):
        """Block the host until the last :meth:`copy` landed (no-op on CPU)."""
        if self._ready is not None:
            self._ready.synchronize()


class DecodeSelection:
    """The choosing part of one decode step (see the module doc); built by :meth:`build`.

    Attributes:
        blocks: the candidates of the choosing sequences (``nanovllm.sparse.DecodeBlocks``).
        fixed_loads: ``(batch row, host block)`` every layer reads whatever the query, in order;
            fixed_skips: for each, the tokens before the sliding window (its first block's).
        starts: int32 ``[B]`` device tensor, the tokens before the window at the head of each row's
            table (its first block, when read in place); None without a window.
        groups: None when one gather and one paged read serve the batch; else each group of
            choosing sequences as ``(group index, batch rows)`` (an int64 device tensor; the
            sequences that do not choose with group 0).
        picks: the policy's picks of each layer so far (int64 ``[S, k]`` device tensors).
    """

    def __init__(self, rows: list[_Row], choosing: list[int], layout: TierRows, num_gpu_blocks: int,
                 block_size: int, device: torch.device):
        self.rows, self.choosing, self.layout = rows, choosing, layout
        self.block_size, self.device = block_size, device
        self.fixed_loads = [(r, row.host_table[j]) for r, row in enumerate(rows) for j in row.fixed
                            if row.gpu_table[j] == NO_BLOCK]
        self.fixed_skips = [row.skip if j == 0 else 0 for row in rows for j in row.fixed
                            if row.gpu_table[j] == NO_BLOCK]
        self.starts = None
        self.num_host_blocks = sum(h != NO_BLOCK for row in rows for h in row.host_table)
        self.picks: list[torch.Tensor] = []
        self.width = max(len(rows[r].gpu_table) for r in choosing)
        self.blocks = self._candidates(num_gpu_blocks)

    @classmethod
    def build(cls, policy: SparsePolicy, tables: list[tuple[list[int], list[int], int]], layout: TierRows,
              num_gpu_blocks: int, block_size: int, device: torch.device,
              reuse: ReuseCache | None = None, skips: list[int] | None = None) -> "DecodeSelection | None":
        """The step's selection, or None when the policy selects for no sequence.

        Args:
            tables: per sequence of the batch, ``(GPU-tier table, host-tier table, length)``; with a
                sliding window, from the window's first block (the policy chooses among those:
                the first of them is its first block).
            layout: the rows of the GPU tier (``tier_rows.py``).
            num_gpu_blocks: GPU-tier blocks (host block ``h`` has metadata slot
                ``num_gpu_blocks + h``).
            reuse: the reuse cache, whose victims this step takes.
            skips: with a sliding window, each sequence's tokens of its first block before the
                window (read from the next; None: no window).
        """
        if not policy.chooses_decode_blocks:
            return None
        rows, choosing = [], []
        for r, (gpu_table, host_table, length) in enumerate(tables):
            n = len(gpu_table)
            if gpu_table[-1] == NO_BLOCK:
                raise RuntimeError(f"the block a decode step writes (block {n - 1}) must be in the GPU tier, "
                                   f"found host block {host_table[-1]}")
            selects = policy.selects(n)
            fixed = sorted(set(policy.fixed_decode_blocks(n)) | {n - 1}) if selects else list(range(n))
            rows.append(_Row(gpu_table, host_table, length, fixed, len(choosing) if selects else -1,
                             policy.max_decode_picks(n - len(fixed)) if selects else 0, block_size,
                             skips[r] if skips else 0))
            if selects:
                choosing.append(len(rows) - 1)
        if not choosing:
            return None
        selection = cls(rows, choosing, layout, num_gpu_blocks, block_size, device)
        if skips is not None:
            selection.starts = to_device([row.skip if row.gpu_table[0] != NO_BLOCK else 0 for row in rows],
                                         torch.int32, device)
        selection._upload(policy, reuse)
        return selection

    def num_reads(self) -> int:
        """Blocks each layer reads for the batch at most: a choosing sequence's fixed blocks and
        its ``max_decode_picks`` (an upper bound in general; QUEST always picks that many, having
        more candidates than top-k whenever it selects), every block of the others."""
        return sum(row.num_reads() for row in self.rows)

    def _candidates(self, num_gpu_blocks: int) -> DecodeBlocks:
        """The candidates of the choosing sequences: metadata slots ``[S, W]`` (W their longest
        table), NO_BLOCK for fixed blocks and padding."""
        slots = []
        for r in self.choosing:
            row, fixed = self.rows[r], set(self.rows[r].fixed)
            slots.append([NO_BLOCK if j in fixed else g if g != NO_BLOCK else num_gpu_blocks + h
                          for j, (g, h) in enumerate(zip(row.gpu_table, row.host_table))])
        return DecodeBlocks(self.choosing, [len(self.rows[r].gpu_table) for r in self.choosing],
                            to_device(padded_rows(slots, self.width), torch.int64, self.device))

    # ---- step start (host) -------------------------------------------------------------
    def _upload(self, policy: SparsePolicy, reuse: ReuseCache | None):
        """Plan the step on the host (victims, groups) and upload what the layers read."""
        rows = [self.rows[r] for r in self.choosing]
        worst = [policy.max_decode_picks(row.host_candidates()) for row in rows]
        victims = reuse.begin_step(sum(worst)) if reuse is not None else [[] for _ in range(self.layout.num_layers)]
        try:
            self._host_tensors(rows, victims, reuse)
            group_of = self._plan_groups(worst, min(map(len, victims)))
        except BaseException:
            if reuse is not None:  # the step will not run: its victims keep what they hold
                reuse.abort_step()
            raise
        group_first = [group_of.index(g) for g in group_of]
        self.group_first_host = torch.tensor(group_first)
        self.group_first = to_device(group_first, torch.int64, self.device)  # pinned: no host sync
        self.group_of = to_device(group_of, torch.int64, self.device)
        self.groups = None if group_of[-1] == 0 else [
            (g, to_device([self.choosing[s] for s, x in enumerate(group_of) if x == g]
                          + ([r for r, row in enumerate(self.rows) if row.choosing < 0] if g == 0 else []),
                          torch.int64, self.device))
            for g in range(group_of[-1] + 1)]
        dev = {name: t.to(self.device, non_blocking=True) for name, t in self.planned.items()}
        self.in_place, self.host_ids, self.fixed_read = dev["in_place"], dev["host_ids"], dev["fixed_read"]
        self.free_tokens, self.victims, self.num_victims = dev["free_tokens"], dev["victims"], dev["num_victims"]
        self.query_rows = None if len(self.choosing) == len(self.rows) else to_device(self.choosing, torch.int64,
                                                                                      self.device)
        self._other_tables()

    def _host_tensors(self, rows: list[_Row], victims: list[list[int]], reuse: ReuseCache | None):
        """The step's tensors on the host (``planned``, kept for :meth:`replay`)."""
        layout, width = self.layout, self.width
        gpu = torch.tensor(padded_rows([r.gpu_table for r in rows], width), dtype=torch.int64)
        host = torch.tensor(padded_rows([r.host_table for r in rows], width), dtype=torch.int64)
        fixed = torch.zeros(len(rows), width, dtype=torch.bool)
        for s, row in enumerate(rows):
            fixed[s, row.fixed] = True
        offsets = torch.arange(layout.num_layers)[:, None, None] * layout.layer_rows
        cached = self._cached_rows(host, reuse)  # [L, S, W] reuse-cache rows, -1
        in_place = torch.where(gpu >= 0, gpu + offsets, torch.where(cached >= 0, cached + offsets, -1))
        most = max(1, max(map(len, victims)))
        victim_rows = torch.tensor([[layout.row(layer, v) for v in vs] + [-1] * (most - len(vs))
                                    for layer, vs in enumerate(victims)], dtype=torch.int64)
        self.planned = {"in_place": in_place, "host_ids": host, "fixed_read": fixed & (gpu >= 0),
                     "free_tokens": torch.tensor([r.free_tokens for r in rows], dtype=torch.int64),
                     "victims": victim_rows, "num_victims": torch.tensor([len(v) for v in victims])}
        if self.device.type == "cuda":
            self.planned = {name: t.pin_memory() for name, t in self.planned.items()}

    def _cached_rows(self, host: torch.Tensor, reuse: ReuseCache | None) -> torch.Tensor:
        """int64 ``[L, S, W]``: the reuse-cache row (GPU-tier block id) of each host block, -1."""
        num_layers = self.layout.num_layers
        if reuse is None:
            return torch.full((num_layers, *host.shape), -1, dtype=torch.int64)
        lookup = torch.full((num_layers, int(host.max()) + 2), -1, dtype=torch.int64)  # last column: no block
        entries = [(layer, host_id, row) for layer in range(num_layers)
                   for host_id, row in reuse.cached(layer).items() if host_id < lookup.shape[1] - 1]
        if entries:  # one indexed write, not one per entry (host time: docs/benchmarks.md, bench_selection_host)
            layers, host_ids, rows = zip(*entries)
            lookup[list(layers), list(host_ids)] = torch.tensor(rows)
        return lookup[:, torch.where(host >= 0, host, lookup.shape[1] - 1)]

    def _plan_groups(self, worst: list[int], victims: int) -> list[int]:
        """The group of each choosing sequence: consecutive sequences whose worst-case misses
        beyond the victims (and the earlier groups' worst-case misses) fit the staging rows."""
        staging = self.layout.staging_rows
        group_of, group, start, before = [], 0, 0, 0
        for s, w in enumerate(worst):
            if w > staging:
                raise RuntimeError(f"a sequence may miss {w} picked host blocks per layer, more than the "
                                   f"{staging} staging rows")
            size = sum(worst[start:s + 1])
            if min(size, before + size - victims) > staging:
                group, start, before = group + 1, s, before + sum(worst[start:s])
            group_of.append(group)
        return group_of

    def _other_tables(self):
        """Block tables (local block ids) and context lengths of the batch; the rows of the
        choosing sequences are written per layer. The tables are as wide as the most blocks a row
        reads (a choosing row: its fixed GPU-tier blocks and its most picks), not as its logical
        blocks: the paged kernel splits its work by the table's width."""
        tables = [[] if row.choosing >= 0 else [g for g in row.gpu_table if g != NO_BLOCK] for row in self.rows]
        width = max(max(map(len, tables)), max(row.num_fixed_gpu() + row.max_picks
                                               for row in self.rows if row.choosing >= 0))
        lens = [len(t) * self.block_size - row.free_tokens if row.choosing < 0 else 0
                for t, row in zip(tables, self.rows)]
        self.other_tables = to_device(padded_rows(tables, width), torch.int64, self.device)
        self.other_lens = to_device(lens, torch.int64, self.device)
        self.choice = to_device([row.choosing for row in self.rows], torch.int64, self.device)

    # ---- per layer (device) ------------------------------------------------------------
    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The decode queries ``[S, Hq, D]`` of the choosing sequences, from the batch's ``q``."""
        return q if self.query_rows is None else q[self.query_rows]

    def layer_reads(self, layer: int, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
        """What ``layer`` reads given the policy's picks (int64 ``[S, k]``, -1 for none), on the
        device without a host sync (:func:`nanovllm.ops.selected_reads`, one launch):
        ``(src, dst, tables, lens)``: the gather list (host block ids, -1 for none, and rows, int64
        ``[S, k]``), int32 block tables ``[B, TW]`` (rows of :class:`TierRows`) and
        context lengths ``[B]`` of the batch. The tables hold each row's fixed GPU-tier blocks and
        as many picks as the policy's ``max_decode_picks`` allows it (a policy's contract: ``picks``
        may have more columns, -1 beyond a row's valid picks)."""
        return selected_reads(picks, self.in_place, self.host_ids, self.fixed_read, self.victims, self.num_victims,
                              layer, self.group_first, self.free_tokens, self.layout.staging_base, self.block_size,
                              self.other_tables, self.other_lens, layer * self.layout.layer_rows, self.choice)

    def gathered(self, picks: torch.Tensor) -> None:
        """The next layer's picks were read (their gathers launched): :meth:`replay` records them."""
        self.picks.append(picks)

    def group_src(self, group: int, src: torch.Tensor) -> torch.Tensor:
        """The gather list ``src`` restricted to the sequences of ``group``."""
        return torch.where(self.group_of[:, None] == group, src, -1)

    # ---- after the step (host) ---------------------------------------------------------
    def replay(self, picks: list[torch.Tensor], reuse: ReuseCache | None, stats: SparseStats, host_tier) -> None:
        """Record the step from its picks (host tensors, one per layer that ran): where each miss
        landed (the reuse cache's entries), the reuse and traffic statistics, the bytes read. The
        layers that ran are replayed at once (one :func:`pick_rows` over all of them): the host
        does this between two steps, while the GPU waits."""
        h, done = self.planned, len(picks)
        if reuse is not None:
            for layer in range(done, self.layout.num_layers):  # the step stopped before these layers' gathers
                reuse.release(layer)
        if not done:
            return
        layer_picks = pad_sequence([p.view(len(self.choosing), -1).T for p in picks], batch_first=True,
                                   padding_value=-1).transpose(1, 2)  # [done, S, k]: -1 pads a layer's fewer picks
        rows, miss = pick_rows(layer_picks, h["in_place"][:done], h["victims"][:done], h["num_victims"][:done],
                               self.group_first_host, self.layout.staging_base)
        misses = miss.sum((1, 2)).tolist()
        if reuse is not None:
            self._record_reuse(reuse, stats, layer_picks, rows, miss)
        if self.num_host_blocks:
            for layer, num_misses in enumerate(misses):
                stats.add_comm(layer, False, len(self.fixed_loads) + num_misses, self.num_host_blocks)
        host_tier.note_gathered(sum(misses))

    def _record_reuse(self, reuse: ReuseCache, stats: SparseStats, picks, rows, miss) -> None:
        """The reuse cache's outcome of each replayed layer (``[layers, S, k]`` tensors)."""
        host_ids = self.planned["host_ids"].expand(picks.shape[0], -1, -1).gather(2, picks.clamp(min=0))
        host_pick = (picks >= 0) & (host_ids >= 0)
        hits = host_pick & ~miss
        placed = miss & (rows < self.layout.staging_base)
        local = rows - torch.arange(rows.shape[0])[:, None, None] * self.layout.layer_rows
        # to Python once, not by per-layer tensor indexing (host time: docs/benchmarks.md, bench_selection_host)
        num_hits, num_picked = hits.sum((1, 2)).tolist(), host_pick.sum((1, 2)).tolist()
        host_ids, hits, placed, local = (t.flatten(1).tolist() for t in (host_ids, hits, placed, local))
        for layer, (ids, hit, place, row) in enumerate(zip(host_ids, hits, placed, local)):
            reuse.record(layer, [h for h, x in zip(ids, hit) if x], [(h, r) for h, r, x in zip(ids, row, place) if x])
            if num_picked[layer]:
                stats.add_reuse(layer, num_hits[layer], num_picked[layer])
