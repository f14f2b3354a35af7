"""CUDA graphs for decode: one graph per captured batch size, sharing one memory pool.

Captured sizes are 1, 2, 4, 8 and every multiple of 16 up to ``max_num_seqs`` (and
``max_num_seqs`` itself); a batch is padded to the next captured size. Padded rows have
``slot_mapping = -1`` and ``context_lens = 0``, so they neither write nor read the KV cache. A
model with sliding windows gets, per distinct window, its own table, lengths and starts buffers
(as wide as the most blocks the window spans); a model without keeps exactly the buffers above.

With a policy that chooses decode pages, the cache's ``choosing_graph_sizes`` get a second graph
each: the whole choosing decode (the policy's scores and top-k, each KV head's page tables, the
page-level reads) over a fixed-shape selection (``DecodeSelection.for_graphs``: candidates padded
to ``max_model_len``; with a host tier also the gather of host pages, the reuse cache and the
staging pages), into which a step's selection is copied before the replay. A step whose every row
chooses, in one group, with nothing read through the ring, replays it (``ctx.graph_batch``,
``step_inputs.py``).
"""
import torch

from nanovllm.kvcache.context import Context, WindowReads, get_context, reset_context, set_context
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.kvcache.window import window_table_width


def captured_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captures the model's decode forward (not the sampler) for every size in
    :func:`captured_batch_sizes`, and the choosing decode's for the cache's
    ``choosing_graph_sizes`` (up to ``CHOOSING_GRAPH_SEQS`` sequences; module doc). ``replay``
    returns hidden states ``[batch, hidden]``."""

    def __init__(self, runner):
        cfg = runner.config
        self.model = runner.model
        self.sizes = captured_batch_sizes(cfg.max_num_seqs)
        max_bs = self.sizes[-1]
        max_blocks = -(-cfg.max_model_len // cfg.kvcache_block_size)
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=dev)
        windows = runner.cache.windows
        self.full_attention = None in windows
        self.windows = {w: WindowReads(
            torch.full((max_bs, window_table_width(w, cfg.kvcache_block_size, cfg.max_model_len)), -1,
                       dtype=torch.int32, device=dev),
            torch.zeros(max_bs, dtype=torch.int32, device=dev), torch.zeros(max_bs, dtype=torch.int32, device=dev))
            for w in sorted({w for w in windows if w is not None})}
        self.outputs = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.selections = {bs: runner.cache.graph_selection(bs) for bs in runner.cache.choosing_graph_sizes}
        self.choosing_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._capture_all()

    def _context(self, bs: int, selection: DecodeSelection | None = None) -> Context:
        windows = {w: WindowReads(r.block_tables[:bs], r.context_lens[:bs], r.context_starts[:bs])
                   for w, r in self.windows.items()}
        return Context(is_prefill=False, slot_mapping=self.slot_mapping[:bs], context_lens=self.context_lens[:bs],
                       block_tables=self.block_tables[:bs], windows=windows, selection=selection)

    @torch.inference_mode()
    def _capture_all(self):
        for bs in reversed(self.sizes):
            self.graphs[bs] = self._capture(bs, None)
        for bs, selection in sorted(self.selections.items(), reverse=True):
            self.choosing_graphs[bs] = self._capture(bs, selection)

    def _capture(self, bs: int, selection: DecodeSelection | None) -> torch.cuda.CUDAGraph:
        set_context(self._context(bs, selection))
        out = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up
        if self.outputs is None:
            self.outputs = torch.empty(self.sizes[-1], out.size(-1), dtype=out.dtype, device=out.device)
        if selection is not None:
            selection.reset_plans()  # the captured layers compute them from the selection's tensors
        graph = self._record(bs)
        reset_context()
        return graph

    def _record(self, bs: int) -> torch.cuda.CUDAGraph:
        """The forward of the first ``bs`` rows under the current context, captured."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            self.outputs[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Copy the decode inputs (and the current context, its selection included) into the
        graph's buffers, replay; ``input_ids`` is padded to a captured size (``ctx.graph_batch``)."""
        bs = input_ids.size(0)
        ctx = get_context()
        graph_bs = ctx.graph_batch
        self.input_ids[:bs] = input_ids
        self.positions[:bs] = positions
        self.slot_mapping[:graph_bs].fill_(-1)
        self.slot_mapping[:bs] = ctx.slot_mapping
        if self.full_attention:
            self.context_lens[:graph_bs].zero_()
            self.context_lens[:bs] = ctx.context_lens
            width = ctx.block_tables.size(1)
            self.block_tables[:bs, :width] = ctx.block_tables
        for window, buffers in self.windows.items():
            reads = ctx.windows[window]
            buffers.context_lens[:graph_bs].zero_()
            buffers.context_lens[:bs] = reads.context_lens
            buffers.context_starts[:bs] = reads.context_starts
            buffers.block_tables[:bs, :reads.block_tables.size(1)] = reads.block_tables
        if ctx.selection is None:
            self.graphs[graph_bs].replay()
        else:
            self.selections[graph_bs].load(ctx.selection)
            self.choosing_graphs[graph_bs].replay()
        return self.outputs[:bs]

    def release(self):
        self.graphs.clear()
        self.choosing_graphs.clear()
        self.selections.clear()
        self.pool = None
        self.outputs = None
