"""What a decode step reads when the sparse policy chooses pages per KV head (QUEST, STREAMING),
decided on the device: the picks never come back to the host.

A page is ``policy.page_size`` tokens. A sequence that the policy selects for (more candidate
pages than its budget, :meth:`~nanovllm.sparse.SparsePolicy.selects`) reads, per KV head and
layer, its fixed pages (sinks, recent pages, the page being written) and the policy's picks among
the others; every other sequence reads all of its pages. At the step's start
:meth:`DecodeSelection.build` (host, a pass over the sequences' block tables) uploads the block
tables; one device pass turns them into, per logical page, its page in the GPU tier (``phys``) or
on the host (``host_pages``), the candidates' metadata pages, and the page tables of the
sequences that do not select. Per layer :meth:`DecodeSelection.layer_reads` (torch ops on the
device, shapes fixed per step, no host sync):

- builds each choosing (sequence, KV head)'s reads: fixed pages and picks, as logical pages;
- reads GPU-tier pages in place; host pages through the reuse cache (``reuse.py``: a hit is read
  in its cell, a miss is gathered into a free cell or a staging page, per (page, KV head));
- returns the paged decode kernel's per-head page tables over the GPU tier's rows viewed as pages
  (``tier_rows.py``), the context lengths, and the gather list (host page, KV head, page).

The host blocks of the sequences that read everything (and of every sequence at the policy's
dense layers) stream through the ring as in FULL decode and are folded in by LSE. A step whose
host reads could exceed the staging pages is read in groups of sequences (gather and attention per
group), the staging pages reused group after group.
"""
import torch

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.reuse import ReuseCache
from nanovllm.kvcache.tier_rows import TierRows
from nanovllm.sparse import DecodeCandidates, SparsePolicy
from nanovllm.utils.ints import cdiv
from nanovllm.utils.tensors import padded_rows, to_device


class LayerReads:
    """One layer's reads of one group of rows: int32 ``tables [G, Hkv, W]`` (page ids of the table of
    rows viewed as pages, -1 padded) and ``lens [G]`` (tokens each row reads per head), the
    gather list (int64 ``[n]`` host pages, -1: none; KV heads; destination pages) and device counts
    of the host pages read and missed (``[]`` int64); the gather list and the counts are None in a
    step without host blocks."""

    __slots__ = ("tables", "lens", "src", "heads", "dst", "host_reads", "misses")

    def __init__(self, tables, lens, src, heads, dst, host_reads, misses):
        self.tables, self.lens, self.src, self.heads, self.dst = tables, lens, src, heads, dst
        self.host_reads, self.misses = host_reads, misses


class DecodeSelection:
    """The choosing part of one decode step (module doc); built by :meth:`build`, or of fixed
    shapes for CUDA graphs by :meth:`for_graphs`.

    Attributes:
        candidates: the candidate pages of the choosing sequences.
        choosing: their rows in the batch.
        ring_loads: per layer, ``(batch row, host block)`` read whole through the ring.
        groups: per group, ``(indices among the choosing sequences, batch rows)`` (int64 device
            tensors; the group's choosing rows, then with group 0 the rows that do not choose);
            one group for the batch when the staging pages suffice.
        in_batch_order: one group whose rows are the batch's in order (its reads' outputs are the
            batch's as they are).
        counted: the attention counts its reads (:meth:`read_tokens`); not a graph's selection
            (:meth:`for_graphs`), whose step's selection is counted instead.
    """

    def __init__(self, policy: SparsePolicy, tables: list[tuple[list[int], list[int], int]], choosing: list[int],
                 layout: TierRows, num_gpu_blocks: int, block_size: int, num_kv_heads: int, device: torch.device):
        self.policy, self.layout, self.device = policy, layout, device
        self.choosing, self.num_kv_heads = choosing, num_kv_heads
        page, ppb = policy.page_size, block_size // policy.page_size
        self.page_size, self.pages_per_block = page, ppb
        lengths = [length for _, _, length in tables]
        num_pages = [cdiv(length, page) for length in lengths]
        free = [n * page - length for n, length in zip(num_pages, lengths)]
        chooses = set(choosing)
        others = [r for r in range(len(tables)) if r not in chooses]
        self.others = others
        # ring: the host blocks of the rows that read everything, every row's at the dense layers
        every = [(r, h) for r, (_, host, _) in enumerate(tables) for h in host if h != NO_BLOCK]
        rest = [(r, h) for r, h in every if r not in chooses]
        self.ring_loads = [every if layer < policy.dense_layers else rest for layer in range(layout.num_layers)]
        self.num_host_blocks = len(every)
        self.has_host_pages = bool(every)
        # per-step device tensors: every page's place in either tier
        width = max(len(gpu) for gpu, _, _ in tables)
        gpu_tab = to_device(padded_rows([gpu for gpu, _, _ in tables], width), torch.int64, device)
        host_tab = to_device(padded_rows([host for _, host, _ in tables], width), torch.int64, device)
        pages = torch.arange(width * ppb, device=device)
        in_range = pages < to_device(num_pages, torch.int64, device)[:, None]
        gpu_page, host_page = (t.repeat_interleave(ppb, dim=1) for t in (gpu_tab, host_tab))
        offset = pages % ppb
        self.phys = torch.where((gpu_page >= 0) & in_range, gpu_page * ppb + offset, -1)
        self.host_pages = torch.where((host_page >= 0) & in_range, host_page * ppb + offset, -1)
        meta = torch.where(gpu_page >= 0, gpu_page, num_gpu_blocks + host_page) * ppb + offset
        # the choosing rows: fixed pages (the policy's), candidates
        first, num_fixed = policy.sink_pages, policy.num_fixed_pages
        fixed = [[*sinks, *last] for sinks, last in (policy.fixed_pages(num_pages[r]) for r in choosing)]
        self.fixed = to_device(fixed, torch.int64, device)  # [S, F]
        rows = to_device(choosing, torch.int64, device)
        cand_count = to_device([num_pages[r] - num_fixed for r in choosing], torch.int64, device)
        num_cand = max(num_pages[r] for r in choosing) - num_fixed
        columns = torch.arange(num_cand, device=device)
        cand = meta[rows][:, first:first + num_cand]
        cand = torch.where(columns < cand_count[:, None], cand, -1)
        self.candidates = DecodeCandidates(choosing, cand, first, num_kv_heads)
        self.rows = rows
        self.num_fixed = num_fixed
        self.reads = num_fixed + policy.budget_pages  # the most pages a choosing (row, head) reads at a layer
        self.choose_free = to_device([free[r] for r in choosing], torch.int32, device)
        self._choose_free, self._lengths = [free[r] for r in choosing], lengths
        # the rows that read everything: their GPU pages, compacted (host pages read through the ring)
        other_rows = to_device(others, torch.int64, device) if others else None
        if others:
            phys = self.phys[other_rows]
            order = (phys < 0).to(torch.int8).argsort(dim=1, stable=True)
            compact = phys.gather(1, order)
            gpu_pages = [sum(max(0, min(ppb, num_pages[r] - j * ppb)) for j, g in enumerate(tables[r][0])
                             if g != NO_BLOCK) for r in others]
            other_lens = [n * page - free[r] for n, r in zip(gpu_pages, others)]
            other_width = max(1, max(gpu_pages))
            self.other_tables = compact[:, :other_width]
        else:
            other_lens, other_width, self.other_tables = [], 0, None
        self.other_lens = to_device(other_lens, torch.int32, device)
        self.context_tokens = sum(lengths)
        self.counted = True
        self.groups = self._plan_groups(tables, choosing, others)
        self.in_batch_order = len(self.groups) == 1 and choosing + others == list(range(len(tables)))
        self._plans: dict[tuple[int, int], _GroupPlan] = {}

    @classmethod
    def for_graphs(cls, policy: SparsePolicy, batch: int, max_model_len: int, layout: TierRows, block_size: int,
                   num_kv_heads: int, device: torch.device,
                   host_counts: torch.Tensor | None = None) -> "DecodeSelection":
        """A selection of fixed shapes for decode CUDA graphs: ``batch`` rows that all choose,
        candidates padded to the pages of ``max_model_len``; :meth:`load` copies a step's
        selection into it (its tensors are the graphs' inputs). Its reads are not counted (the
        step's own selection is, :meth:`read_tokens`). With ``host_counts`` (int64 ``[2, L]`` on the
        device, which the graphs' layers add their host (page, KV head) reads and misses to, in
        place: :meth:`count_host_reads`) each page is in either tier and the gather of host pages
        is captured too; without, every page is in the GPU tier."""
        self = cls.__new__(cls)
        self.policy, self.layout, self.device, self.num_kv_heads = policy, layout, device, num_kv_heads
        page = policy.page_size
        self.page_size, self.pages_per_block = page, block_size // page
        max_pages = cdiv(max_model_len, block_size) * self.pages_per_block
        self.num_fixed = policy.num_fixed_pages
        self.choosing, self.others, self.num_host_blocks = list(range(batch)), [], 0
        self.has_host_pages = host_counts is not None
        self.host_counts = host_counts
        self.ring_loads = [[] for _ in range(layout.num_layers)]
        self.rows = torch.arange(batch, device=device)
        self.phys = torch.full((batch, max_pages), -1, dtype=torch.int64, device=device)
        self.host_pages = (torch.full((batch, max_pages), -1, dtype=torch.int64, device=device)
                           if self.has_host_pages else None)
        self.fixed = torch.zeros(batch, self.num_fixed, dtype=torch.int64, device=device)
        cand = torch.full((batch, max_pages - self.num_fixed), -1, dtype=torch.int64, device=device)
        self.candidates = DecodeCandidates(self.choosing, cand, policy.sink_pages, num_kv_heads)
        self.choose_free = torch.full((batch,), self._nothing_free, dtype=torch.int32, device=device)
        self.other_tables = None
        self.context_tokens, self._choose_free, self._lengths = 0, [], []
        self.counted = False
        self.groups = [(self.rows, self.rows)]
        self.in_batch_order = True
        self._plans = {}
        return self

    def graphable(self, host_pages: bool) -> bool:
        """Every row chooses, in one group, nothing is read through the ring, and (unless
        ``host_pages``: the graphs gather host pages) every page is in the GPU tier: the shape of
        :meth:`for_graphs`."""
        return not self.others and len(self.groups) == 1 and not any(self.ring_loads) and (
            host_pages or not self.has_host_pages)

    def load(self, step: "DecodeSelection") -> None:
        """Copy ``step`` (:meth:`graphable` for this selection, of at most its rows, over the same
        ``max_model_len``) into this selection's tensors; the rows past ``step``'s read
        nothing (no pages, length 0). The graphs recompute the per-layer plans (:meth:`_plan`) from
        these tensors at every replay."""
        n, width = len(step.choosing), step.phys.shape[1]
        cand = self.candidates.pages
        pages = ((self.phys, step.phys),) if self.host_pages is None else ((self.phys, step.phys),
                                                                           (self.host_pages, step.host_pages))
        for tensor, value in ((cand, -1), (self.fixed, 0), *((t, -1) for t, _ in pages)):
            tensor[n:].fill_(value)
        for tensor, source in pages:  # columns past the step's: pages no candidate or fixed page reaches
            tensor[:n, :width] = source
        cand[:n, :step.candidates.pages.shape[1]] = step.candidates.pages
        cand[:n, step.candidates.pages.shape[1]:] = -1
        self.fixed[:n] = step.fixed
        self.choose_free[:n] = step.choose_free
        self.choose_free[n:] = self._nothing_free

    @property
    def _nothing_free(self) -> int:
        """A row's unwritten tokens that make it read nothing (its length 0): all its reads'."""
        return (self.num_fixed + self.most_picks) * self.page_size

    @classmethod
    def build(cls, policy: SparsePolicy, tables: list[tuple[list[int], list[int], int]], layout: TierRows,
              num_gpu_blocks: int, block_size: int, num_kv_heads: int,
              device: torch.device) -> "DecodeSelection | None":
        """The step's selection, or None when the policy selects for no sequence.

        Args:
            tables: per sequence of the batch, ``(GPU-tier table, host-tier table, length)``.
            layout: the rows of the GPU tier (``tier_rows.py``).
            num_gpu_blocks: GPU-tier blocks (host block ``h`` has metadata slot
                ``num_gpu_blocks + h``).

        Raises:
            RuntimeError: the block a sequence writes is not in the GPU tier.
        """
        if not policy.chooses_decode_pages:
            return None
        choosing = []
        for r, (gpu_table, host_table, length) in enumerate(tables):
            if gpu_table[-1] == NO_BLOCK:
                raise RuntimeError(f"the block a decode step writes (block {len(gpu_table) - 1}) must be in the GPU "
                                   f"tier, found host block {host_table[-1]}")
            if policy.selects(cdiv(length, policy.page_size)):
                choosing.append(r)
        if not choosing:
            return None
        return cls(policy, tables, choosing, layout, num_gpu_blocks, block_size, num_kv_heads, device)

    def _plan_groups(self, tables, choosing: list[int], others: list[int]):
        """Consecutive choosing sequences whose worst-case host reads per KV head (every read page
        that lives on the host missing the reuse cache) fit the staging pages."""
        staging = self.layout.staging_rows * self.pages_per_block
        worst = [min(self.reads, sum(1 for h in tables[r][1] if h != NO_BLOCK) * self.pages_per_block)
                 for r in choosing]
        groups, current, size = [], [], 0
        for s, w in enumerate(worst):
            if staging and w > staging:
                raise RuntimeError(f"a sequence may read {w} host pages per KV head and layer, more than the "
                                   f"{staging} staging pages")
            if staging and size + w > staging:
                groups.append(current)
                current, size = [], 0
            current.append(s)
            size += w
        groups.append(current)
        return [(to_device(g, torch.int64, self.device),
                 to_device([choosing[s] for s in g] + (others if i == 0 else []), torch.int64, self.device))
                for i, g in enumerate(groups)]

    def num_picks(self, layer: int) -> int:
        """Picks per choosing (row, KV head) at ``layer``: its budget, or every candidate if fewer."""
        return min(self.policy.budget_at(layer), self.candidates.pages.shape[1])

    @property
    def most_picks(self) -> int:
        """The most picks per choosing (row, KV head) at any layer."""
        return min(self.policy.budget_pages, self.candidates.pages.shape[1])

    def reset_plans(self) -> None:
        """Forget the per-layer plans kept so far (before a CUDA-graph capture, so that the
        captured layers compute them from the graph's inputs)."""
        self._plans.clear()

    def count_host_reads(self, layer: int, reads: "LayerReads") -> None:
        """Add ``layer``'s host reads and misses to a graph selection's ``host_counts`` (on the
        device, in place: a graph's replays count)."""
        self.host_counts[0, layer] += reads.host_reads
        self.host_counts[1, layer] += reads.misses

    def read_tokens(self, layer: int, num_picks: int) -> int:
        """Tokens the batch reads per KV head at ``layer`` when each choosing (row, head) reads
        ``num_picks`` picks besides its fixed pages."""
        if layer < self.policy.dense_layers:
            return self.context_tokens
        pages = self.num_fixed + num_picks
        return (sum(self._lengths[r] for r in self.others) +
                sum(min(pages * self.page_size - free, self._lengths[r]) for r, free in zip(self.choosing, self._choose_free)))

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The decode queries ``[S, Hq, D]`` of the choosing sequences, from the batch's ``q``."""
        return q if len(self.choosing) == q.shape[0] else q[self.rows]

    def layer_reads(self, layer: int, picks: torch.Tensor, group: int, reuse: ReuseCache | None) -> LayerReads:
        """What ``layer`` reads for the rows of ``groups[group]`` given the policy's picks (int64
        ``[S, Hkv, k]`` columns of the candidates, -1 for none), on the device (module doc). Only the
        picks' places are looked up per layer; the fixed pages', the lengths and the rows that read
        everything are the step's (:meth:`_plan`). In a step without host blocks the gather list is
        None (nothing to gather, nothing counted)."""
        plan = self._plan(group, picks.shape[2])
        heads, num = self.num_kv_heads, plan.num
        layer_page = layer * self.layout.layer_rows * self.pages_per_block
        picks = picks if plan.indices is None else picks[plan.indices]
        index = (picks + self.candidates.first).clamp_(min=0).flatten(1)
        valid = picks >= 0
        gpu = torch.where(valid, plan.phys.gather(1, index).view_as(picks), -1)
        gpu = torch.cat([plan.sink_gpu, gpu, plan.tail_gpu], dim=2)
        if plan.host is None:  # the step has no host block
            chosen, src = torch.where(gpu >= 0, gpu + layer_page, -1), None
            dst = heads_of = host_reads = misses = None
        else:
            host = torch.where(valid, plan.host.gather(1, index).view_as(picks), -1)
            host = torch.cat([plan.sink_host, host, plan.tail_host], dim=2)
            host = torch.where(gpu < 0, host, -1)
            host_by_head = host.transpose(0, 1).flatten(1)  # [Hkv, S x E]: (sequence, read) order per head
            staging_page = self.layout.staging_base * self.pages_per_block
            if reuse is not None:
                pages, miss = reuse.place(layer, host_by_head, staging_page)
            else:
                miss = host_by_head >= 0
                pages = torch.where(miss, staging_page + miss.long().cumsum(1) - 1, -1)
            chosen = torch.where(gpu >= 0, gpu + layer_page, pages.view(heads, num, -1).transpose(0, 1))
            src = torch.where(miss, host_by_head, -1).flatten()
            heads_of = torch.arange(heads, device=self.device).repeat_interleave(miss.shape[1])
            dst = pages.flatten()
            host_reads, misses = (host_by_head >= 0).sum(), miss.sum()
        if plan.other_tables is None:
            tables = chosen.to(torch.int32)
        else:
            tables = torch.full((num + plan.other_tables.shape[0], heads, max(chosen.shape[2], plan.other_tables.shape[2])),
                                -1, dtype=torch.int32, device=self.device)
            tables[:num, :, :chosen.shape[2]] = chosen
            tables[num:, :, :plan.other_tables.shape[2]] = torch.where(plan.other_tables >= 0,
                                                                       plan.other_tables + layer_page, -1)
        return LayerReads(tables, plan.lens, src, heads_of, dst, host_reads, misses)

    def _plan(self, group: int, num_picks: int) -> "_GroupPlan":
        """The layer-independent part of ``groups[group]``'s reads with ``num_picks`` picks per (row,
        KV head), built at the step's first layer and kept for the others."""
        key = (group, num_picks)
        if key not in self._plans:
            self._plans[key] = _GroupPlan(self, group, num_picks)
        return self._plans[key]


class _GroupPlan:
    """What every layer's reads of one group share (device tensors): its choosing rows' pages in the
    GPU tier (``phys [num, P]``) and on the host (``host``, None when the step has no host block),
    the places of the fixed pages before and after the picks (``sink_*``, ``tail_* [num, Hkv, n]``),
    the rows' lengths (int32, the others' after the choosing rows'), and the tables of the rows that
    read everything without the layer's offset (``other_tables [n, Hkv, W]``, -1 padded; group 0
    only, None when there are none)."""

    def __init__(self, selection: DecodeSelection, group: int, num_picks: int):
        indices = selection.groups[group][0]
        heads, sink = selection.num_kv_heads, selection.policy.sink_pages
        self.indices = None if len(selection.groups) == 1 else indices  # one group: every choosing row
        rows = selection.rows if self.indices is None else selection.rows[indices]
        fixed = selection.fixed if self.indices is None else selection.fixed[indices]
        self.num = num = fixed.shape[0]
        self.phys = selection.phys[rows]
        fixed_gpu = self.phys.gather(1, fixed)
        self.sink_gpu, self.tail_gpu = (t[:, None, :].expand(num, heads, t.shape[1])
                                        for t in (fixed_gpu[:, :sink], fixed_gpu[:, sink:]))
        if selection.has_host_pages:
            self.host = selection.host_pages[rows]
            fixed_host = torch.where(fixed_gpu < 0, self.host.gather(1, fixed), -1)
            self.sink_host, self.tail_host = (t[:, None, :].expand(num, heads, t.shape[1])
                                              for t in (fixed_host[:, :sink], fixed_host[:, sink:]))
        else:
            self.host = None
        reads = (fixed.shape[1] + num_picks) * selection.page_size
        choose_free = selection.choose_free if self.indices is None else selection.choose_free[indices]
        self.lens = (reads - choose_free).clamp_(min=0).to(torch.int32)  # a graph's padded rows: 0
        self.other_tables = None
        if group == 0 and selection.other_tables is not None:
            self.lens = torch.cat([self.lens, selection.other_lens])
            self.other_tables = selection.other_tables[:, None, :].expand(-1, heads, -1)
