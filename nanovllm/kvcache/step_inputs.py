"""A step's model inputs and attention context, built from the scheduled sequences' block tables.

    builder = StepInputs(block_size, device, tiered, decode_batch_sizes, max_model_len, windows, choosing_batch_sizes)
    ctx, input_ids, positions, sample_idx = builder.prefill(seqs)          a prefill chunk per sequence
    ctx, input_ids, positions, sample_idx = builder.decode(seqs, selection)  one token per sequence

Each sequence brings its two block tables (GPU tier, host tier; ``nanovllm.sequence``) and its
progress (``num_computed_tokens``, ``num_scheduled_tokens``, ``samples_token``, decided by the
scheduler). Slots are ``gpu_block * block_size + offset``; a position inside the cached prefix
gets slot -1 (its shared block is never written). Decode builds one set of reads per distinct
sliding window of the model's layers (``window.py``) beside the full-attention one (only for the
windows and kinds its layers have); a prefix gather begins at the block the widest window shows.
"""
import torch

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.context import Context, PrefixGather, WindowReads
from nanovllm.kvcache.window import widest_window, window_row, window_start, window_table_width
from nanovllm.sequence import Sequence
from nanovllm.utils.tensors import padded_rows, to_device


class StepInputs:
    """Args: block_size (tokens per block); device; tiered (the cache has a host tier);
    decode_batch_sizes (CUDA: the captured CUDA-graph batch sizes, to which paged-only decode
    batches are padded so that eager and graph decode run the same shapes; None: no padding);
    max_model_len (the widest block table a padded decode batch needs); windows (each layer's
    sliding window, None for full attention; default: one layer without); choosing_batch_sizes
    (the batch sizes of the captured graphs of decode with a choosing policy, to which a batch whose
    selection is :meth:`~nanovllm.kvcache.selection.DecodeSelection.graphable` is padded; None:
    none captured)."""

    def __init__(self, block_size: int, device: torch.device, tiered: bool, decode_batch_sizes: list[int] | None,
                 max_model_len: int, windows: list[int | None] = (None,), choosing_batch_sizes: list[int] | None = None):
        self.block_size, self.device, self.tiered = block_size, device, tiered
        self.decode_batch_sizes, self.max_model_len = decode_batch_sizes, max_model_len
        self.choosing_batch_sizes = choosing_batch_sizes
        self.reads = ([None] if None in windows else []) + sorted({w for w in windows if w is not None})
        self.gather_window = widest_window(list(windows))  # a prefix gather covers every layer's window

    def slot(self, seq: Sequence, pos: int) -> int:
        """The GPU-tier slot of position ``pos`` of ``seq`` (-1 inside its cached prefix)."""
        if pos < seq.num_cached_tokens:
            return -1
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """:meth:`slot` of positions ``start .. end - 1``, a range per block."""
        block_size = self.block_size
        pos = min(max(seq.num_cached_tokens, start), end)
        slots = [-1] * (pos - start)
        while pos < end:
            block = pos // block_size
            stop = min((block + 1) * block_size, end)
            base = (seq.block_table[block] - block) * block_size
            slots += range(base + pos, base + stop)
            pos = stop
        return slots

    def prefill(self, seqs: list[Sequence]) -> tuple[Context, list[int], list[int], list[int]]:
        """The context and the inputs ``(input_ids, positions, sample_idx)`` of a prefill step:
        each sequence's scheduled chunk, packed; ``sample_idx`` the rows of the chunks that
        complete their prompt (their last token's logits are sampled)."""
        input_ids, positions, slots, seqlens_q, seqlens_k, sample_idx, gathers = [], [], [], [], [], [], {}
        for i, seq in enumerate(seqs):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.slots(seq, start, end)
            seqlens_q.append(end - start)
            seqlens_k.append(end)
            if seq.samples_token:
                sample_idx.append(len(input_ids) - 1)
            if start and self.tiered:
                gather = self._prefix_gather(seq, start)
                if gather is not None:
                    gathers[i] = gather
        tables = None
        if any(k > q for q, k in zip(seqlens_q, seqlens_k)):
            tables = [seq.block_table for seq in seqs]
            tables = to_device(padded_rows(tables, max(map(len, tables))), torch.int32, self.device)
        ctx = Context(is_prefill=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_tables=tables,
                      slot_mapping=to_device(slots, torch.int64, self.device), prefix_gathers=gathers)
        return ctx, input_ids, positions, sample_idx

    def _prefix_gather(self, seq: Sequence, num_tokens: int) -> PrefixGather | None:
        """Where the first ``num_tokens`` of ``seq`` live (with windows in every layer, from the
        block the widest shows the chunk's first query), when some are on the host tier."""
        num_blocks = -(-num_tokens // self.block_size)
        first = window_start(num_tokens, self.gather_window) // self.block_size
        host = [(j - first, seq.host_block_table[j]) for j in range(first, num_blocks)
                if seq.host_block_table[j] != NO_BLOCK]
        if not host:
            return None
        gpu = [(j - first, seq.block_table[j]) for j in range(first, num_blocks) if seq.block_table[j] != NO_BLOCK]
        return PrefixGather(num_tokens, gpu, host, first * self.block_size)

    def decode(self, seqs: list[Sequence], selection) -> tuple[Context, list[int], list[int], list[int]]:
        """The context and the inputs of a decode step (one token per sequence): each row reads
        its GPU-tier blocks in place and, with a host tier, its host blocks through the ring
        (``host_loads``), unless ``selection`` (a :class:`~nanovllm.kvcache.selection.DecodeSelection`,
        or None) chooses what it reads; the layers of each sliding window read only the blocks in
        it (``ctx.windows``, ``window.py``). A batch that reads only GPU-tier blocks is padded to
        the next captured CUDA-graph size, as is one whose selection the choosing graphs take
        (``ctx.graph_batch``: the size; 0 when the step runs eagerly)."""
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slots = [self.slot(seq, len(seq) - 1) for seq in seqs]
        rows = {window: [window_row(seq.block_table, seq.host_block_table, len(seq), window, self.block_size,
                                    self.tiered) for seq in seqs] for window in self.reads}
        loads = {window: [(r, h) for r, row in enumerate(reads) for h in row.loads] for window, reads in rows.items()}
        if selection is None:  # paged only
            sizes = None if any(loads.values()) else self.decode_batch_sizes
        else:
            sizes = self.choosing_batch_sizes if selection.graphable(host_pages=self.tiered) else None
        graph_batch = next((s for s in sizes or () if s >= len(seqs)), 0)
        pad = graph_batch - len(seqs) if graph_batch else 0  # CUDA: the shapes of the captured graphs
        input_ids, positions, slots = input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        ctx = Context(is_prefill=False, selection=selection, slot_mapping=to_device(slots, torch.int64, self.device),
                      graph_batch=graph_batch)
        for window, reads in rows.items():
            tables, lens = [row.table for row in reads] + [[]] * pad, [row.length for row in reads] + [0] * pad
            width = max(map(len, tables))
            if graph_batch:
                width = max(width, window_table_width(window, self.block_size, self.max_model_len))
            block_tables = to_device(padded_rows(tables, width), torch.int32, self.device)
            context_lens = to_device(lens, torch.int32, self.device)
            if window is None:
                ctx.block_tables, ctx.context_lens, ctx.host_loads = block_tables, context_lens, loads[None]
            else:
                starts = to_device([row.start for row in reads] + [0] * pad, torch.int32, self.device)
                ctx.windows[window] = WindowReads(block_tables, context_lens, starts, loads[window],
                                                  [skip for row in reads for skip in row.skips])
        return ctx, input_ids, positions, list(range(len(seqs)))
