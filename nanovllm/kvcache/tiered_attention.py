"""Attention over a batch whose KV lives in two tiers.

    attention(seq) = attention over its GPU-tier blocks (paged kernels, with LSE)
                   + attention over its host-tier blocks (read through the ring), merged by LSE

- **Prefill** (chunks of several sequences): the chunk's KV is stored in the GPU tier; each chunk
  attends causally to itself and non-causally to its prefix, a segment of the prefix at a time
  (``prefill_attention``: the transient memory does not grow with the context). A prefix in the
  GPU tier is gathered through the block table as in GPU-only mode; a prefix with host blocks is
  read segment by segment from both tiers (its host blocks copied H2D into the segment's buffer,
  :meth:`TieredAttention._prefix_reader`), so the kernels and the summation order are those of
  GPU-only mode. A block-sparse policy (XAttention) masks per sequence over its whole context.
- **Decode**: paged decode attention over the GPU-resident blocks of the whole batch, returning
  the LSE when some sequence has host blocks; then those host blocks stream through the ring in
  groups of slots, each group folded into its rows' ``(out, lse)`` by a paged read and an LSE
  merge (``ring.py``). The loads of a step form one plan across layers, so the ring keeps loading
  the next layer's blocks while this layer computes. A batch without host
  blocks and without a choosing policy is exactly GPU-only decode (and runs in CUDA graphs); a
  batch whose every sequence chooses (in one group, nothing through the ring) replays the
  choosing decode's own graphs (``engine/cuda_graphs.py``), its host pages gathered inside them.
- **Decode with a choosing policy** (QUEST, STREAMING; ``selection.py``): per layer the policy
  picks pages per KV head on the device and the picks never come back to the host: the step's
  selection turns them into per-head page tables over the GPU tier's rows viewed as pages and a
  gather list of the host pages the reuse cache does not hold (``reuse.py``), one kernel gathers
  those (page, KV head) pairs straight from the pinned host tier into free reuse cells or staging
  pages (:func:`nanovllm.ops.gather_host_pages`), one paged read covers GPU-tier pages, cells and
  staging pages, and the ring's blocks (of the sequences that read everything, and of every
  sequence at the policy's dense layers, read as in FULL decode) are folded in. No host sync.
- **Sliding windows** (a layer's ``LayerKVSpec.sliding_window``, ``window.py``): prefill gathers and
  attends to only the prefix tokens the window shows each chunk (``prefill_attention(...,
  sliding_window)``; XAttention's mask intersected with the window); decode reads each window's
  rows (``ctx.windows``: tables from the window's first block, the tokens before the window masked
  by ``context_starts``, the ring loading only host blocks in the window and folding the first from
  its window start); a choosing policy reads the whole window. Layers without a window read as above.
- **FP8 KV** (a spec's ``scale_layout`` "token_head"): keys lose their calibrated offset
  (``key_offset.py``: attention does not see it), then the store quantizes each new token once, its
  scales written beside it (``nanovllm.ops.kv_quant``); every read above passes the scales of the
  rows it reads (GPU tier, ring slots, gathered prefixes and pages) and dequantizes in the kernel,
  and a prefill chunk attends to its own tokens as stored (quantized and dequantized again), so
  chunking, prefix hits and tier splits all see the same values.
"""
import torch

from nanovllm.kvcache.host_tier import HostTier
from nanovllm.kvcache.spec import LayerKVSpec
from nanovllm.kvcache.reuse import ReuseCache
from nanovllm.kvcache.ring import RingReader
from nanovllm.kvcache.tier_rows import TierRows
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.ops import KVStore, block_sparse_attention, decode_attention, prefill_attention, store_kvcache
from nanovllm.ops.prefill_attention import PrefixReader
from nanovllm.ops.kv_quant import dequantize
from nanovllm.ops.store_kv import KVScales
from nanovllm.ops.window_attention import gather_tokens, visible_block_layout, visible_blocks, window_start
from nanovllm.sparse import SparsePolicy, SparseStats
from nanovllm.sparse.stats import causal_visible_blocks
from nanovllm.kvcache.context import Context, PrefixGather, get_context


class TieredAttention:
    """Args: policy (the sparse policy), stats (where densities are counted), scale (softmax),
    specs (each layer's :class:`LayerKVSpec`: its sliding window, its fp8 static scales; default:
    no layer has a window, the cache stores the model's dtype)."""

    def __init__(self, policy: SparsePolicy, stats: SparseStats, scale: float, specs: list[LayerKVSpec] | None = None):
        self.policy, self.stats, self.scale = policy, stats, scale
        self.specs = specs
        self.windows = None if specs is None else [spec.sliding_window for spec in specs]
        self.k_cache = self.v_cache = self.k_rows = self.v_rows = None
        self.k_scales = self.v_scales = self.k_scale_rows = self.v_scale_rows = None
        self.saturated: torch.Tensor | None = None
        self.key_offsets: torch.Tensor | None = None  # an fp8 cache's [L, Hkv, D] (key_offset.py)
        self.host: HostTier | None = None
        self.ring: RingReader | None = None
        self.reuse: ReuseCache | None = None

    def bind(self, rows: torch.Tensor, layout: TierRows, host: HostTier | None, reuse: ReuseCache | None = None,
             scale_rows: torch.Tensor | None = None):
        """The GPU tier as rows ``[2, layout.total, block_size, Hkv, D]`` (keys, values; see
        ``tier_rows.py``), the host tier, the reuse cache, and an fp8 tier's scales
        ``scale_rows`` float32 ``[2, layout.total, block_size, Hkv]`` (rows as ``rows``)."""
        self.k_rows, self.v_rows, self.host, self.reuse = rows[0], rows[1], host, reuse
        self.k_cache, self.v_cache = layout.per_layer(rows)
        self.ring = RingReader(host) if host is not None else None
        if scale_rows is not None:
            self.k_scale_rows, self.v_scale_rows = scale_rows[0], scale_rows[1]
            self.k_scales, self.v_scales = layout.per_layer(scale_rows)
            self.saturated = torch.zeros(1, dtype=torch.int64, device=rows.device)

    def set_key_offsets(self, offsets: torch.Tensor):
        """An fp8 cache's key offsets ``[L, Hkv, D]`` in the model's dtype, subtracted from every
        key before the store (``key_offset.py``)."""
        self.key_offsets = offsets

    def release(self):
        self.k_cache = self.v_cache = self.k_rows = self.v_rows = self.host = self.ring = self.reuse = None
        self.k_scales = self.v_scales = self.k_scale_rows = self.v_scale_rows = None

    def scales(self, layer: int) -> dict:
        """The keyword arguments ``k_scale``, ``v_scale`` of a read of ``layer``'s GPU tier (an
        fp8 cache's scales ``[num_blocks, block_size, Hkv]``; empty for another cache)."""
        return {} if self.k_scales is None else {"k_scale": self.k_scales[layer], "v_scale": self.v_scales[layer]}

    def _store_scales(self, layer: int) -> KVScales | None:
        """What the store of ``layer`` writes scales to: its scales, its spec's static scales
        (None: dynamic) and the saturation counter; None for a cache that is not fp8."""
        if self.k_scales is None:
            return None
        static = None if self.specs is None else self.specs[layer].static_scales
        return KVScales(self.k_scales[layer], self.v_scales[layer], static, self.saturated)

    def forget_host_blocks(self, host_ids: torch.Tensor):
        """Host blocks ``host_ids`` (int64 ``[n]`` on the device) are being rewritten (spills): the
        reuse cache drops their pages."""
        if self.reuse is not None:
            self.reuse.forget(host_ids)

    def window(self, layer: int) -> int | None:
        """``layer``'s sliding window (None: full attention)."""
        return None if self.windows is None else self.windows[layer]

    def _reads(self, layer: int, ctx: Context):
        """``(block_tables, context_lens, context_starts, host_loads, host_skips)`` that a decode
        layer reads without a choosing policy: the full-attention rows, or its window's."""
        window = self.window(layer)
        if window is None:
            return ctx.block_tables, ctx.context_lens, None, ctx.host_loads, None
        r = ctx.windows[window]
        return r.block_tables, r.context_lens, r.context_starts, r.host_loads, r.host_skips

    def begin_step(self, ctx: Context):
        """Plan the step's ring loads: every layer reads ``ctx.host_loads`` (a windowed layer its
        window's), or with a choosing policy each layer's ``selection.ring_loads``, so the whole
        step is one plan; a choosing step starts a step of the reuse cache."""
        if ctx.selection is not None and self.reuse is not None:
            self.reuse.begin_step()
        if self.ring is not None:
            num_layers = self.k_cache.shape[0]
            if ctx.is_prefill:
                reads = []
            elif ctx.selection is None:
                reads = [self._reads(layer, ctx)[3:] for layer in range(num_layers)]
            else:
                reads = [(ctx.selection.ring_loads[layer], None) for layer in range(num_layers)]
            self.ring.reset(reads, 0 if ctx.slot_mapping is None else ctx.slot_mapping.shape[0])

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate=None) -> torch.Tensor:
        """Attention of one layer: q ``[N, Hq, D]``, k, v ``[N, Hkv, D]`` (the batch's new
        tokens, packed) -> ``[N, Hq, D]``; stores k, v in the GPU tier first. ``rotate``
        (:data:`nanovllm.layers.attention.Rotate`): q and k still need RoPE, and it stores k and
        v in the same launch."""
        ctx = get_context()
        if ctx.slot_mapping is None:  # the cache is not touched: warm-up, scoring, calibration
            if rotate is not None:
                q, k = rotate(q, k)
            if ctx.key_sums is not None:
                ctx.key_sums[layer] += k.sum(0, dtype=torch.float32)
            return self._prefill(layer, q, k, v, ctx, None, None)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        store_scales = self._store_scales(layer)
        if rotate is not None and store_scales is None:  # RoPE's launch stores the model's dtype
            q, k = rotate(q, k, kv_store=KVStore(v, k_cache, v_cache, ctx.slot_mapping))
        else:
            if rotate is not None:
                q, k = rotate(q, k)
            if self.key_offsets is not None:  # attention is invariant to the shift (key_offset.py)
                k = k - self.key_offsets[layer]
            # an fp8 prefill chunk attends to its own tokens as stored (quantized once, by the
            # store), as every later read sees them: the output does not depend on how a prompt is
            # chunked or what the prefix cache holds (a recomputed cached token, slot -1, included)
            as_stored = store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping, store_scales,
                                      return_stored=store_scales is not None and ctx.is_prefill)
            if as_stored is not None:
                k, v = as_stored
        if ctx.is_prefill:
            return self._prefill(layer, q, k, v, ctx, k_cache, v_cache)
        if ctx.paged_only:
            if self.window(layer) is None:
                return decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                                        **self.scales(layer))
            tables, lens, starts = self._reads(layer, ctx)[:3]
            return decode_attention(q, k_cache, v_cache, tables, lens, self.scale, context_starts=starts,
                                    **self.scales(layer))
        return self._tiered_decode(layer, q, ctx, k_cache, v_cache)

    # ---- prefill -----------------------------------------------------------------------
    def _prefill(self, layer, q, k, v, ctx: Context, k_cache, v_cache) -> torch.Tensor:
        prefixes = {i: self._prefix_reader(layer, g, q.dtype) for i, g in ctx.prefix_gathers.items()}
        if self.policy.dense_prefill:
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale, k_cache, v_cache,
                                     ctx.block_tables, prefixes, self.window(layer), **self.scales(layer))
        return self._sparse_prefill(layer, q, k, v, ctx, k_cache, v_cache, prefixes)

    def _prefix_reader(self, layer: int, gather: PrefixGather, dtype: torch.dtype) -> PrefixReader:
        """Reads ``layer``'s prefix tokens ``first .. last - 1`` (from ``gather.start`` on) from both
        tiers when attention asks for them (a segment at a time: ``prefill_attention``): the blocks
        holding them copied into new buffers (host blocks H2D, counted), an fp8 cache's dequantized
        with their scales to ``dtype`` (the model's)."""
        block_size = self.k_cache.shape[2]

        def read(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
            begin, end = (first - gather.start) // block_size, -(-(last - gather.start) // block_size)
            gpu_index, gpu_ids, host = gather.blocks(begin, end, self.k_cache.device)
            shape = (end - begin, *self.k_cache.shape[2:])
            out = [torch.empty(shape, dtype=self.k_cache.dtype, device=self.k_cache.device) for _ in range(2)]
            scales = None if self.k_scales is None else [self.k_scales.new_empty(shape[:-1]) for _ in range(2)]
            for buf, cache in zip(out, (self.k_cache, self.v_cache)):
                buf[gpu_index] = cache[layer][gpu_ids]
            for buf, cache in zip(scales or [], (self.k_scales, self.v_scales)):
                buf[gpu_index] = cache[layer][gpu_ids]
            self.host.read_blocks(layer, host, out[0], out[1], None if scales is None else tuple(scales))
            loaded = len(host) * self.host.layer_block_bytes
            self.stats.add_comm(layer, True, loaded, loaded)
            out = [dequantize(buf, scale, dtype) for buf, scale in zip(out, scales or (None, None))]
            skip = first - gather.start - begin * block_size
            return tuple(buf.flatten(0, 1)[skip:skip + last - first] for buf in out)

        return read

    def _sparse_prefill(self, layer, q, k, v, ctx: Context, k_cache, v_cache, prefixes) -> torch.Tensor:
        """Per sequence: the policy's mask over its whole context (with a window, from the block
        the window shows its first query; the mask intersected with the window), then block-sparse
        attention (or dense attention of the whole batch when no sequence is masked)."""
        block_size, heads, window = self.policy.prefill_block_size, q.shape[1], self.window(layer)
        work, start = [], 0
        for i, (len_q, len_k) in enumerate(zip(ctx.seqlens_q, ctx.seqlens_k)):
            rows, start = slice(start, start + len_q), start + len_q
            if not len_q:
                continue
            k_ctx, v_ctx = self._context(layer, i, rows, len_k, k, v, k_cache, v_cache, ctx, prefixes, window)
            mask = self.policy.prefill_mask(q[rows], k_ctx)
            if window is None:
                visible = heads * causal_visible_blocks(len_q, len_k, block_size)
            else:
                visible = heads * visible_blocks(len_q, k_ctx.shape[0], block_size, window)
                if mask is not None:
                    mask = mask & visible_block_layout(*mask.shape[1:], block_size, len_q, k_ctx.shape[0], window,
                                                       mask.device)
            self.stats.add_compute(layer, visible if mask is None else mask.sum(), visible)
            num_prefix = k_ctx.shape[0] - len_q  # the gathered prefix rows (with a window, its last ones)
            prefix = (k_ctx[:num_prefix], v_ctx[:num_prefix]) if num_prefix else None
            work.append((i, rows, k_ctx, v_ctx, prefix, mask))
        if all(mask is None for *_, mask in work):  # the contexts gathered for the masks hold the prefixes
            gathered = {i: prefix for i, _, _, _, prefix, _ in work if prefix is not None}
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale, k_cache, v_cache,
                                     ctx.block_tables, gathered, window, **self.scales(layer))
        out = torch.empty_like(q)
        for _, rows, k_ctx, v_ctx, prefix, mask in work:
            if mask is None:
                len_q, len_k = rows.stop - rows.start, k_ctx.shape[0]
                out[rows] = prefill_attention(q[rows], k[rows], v[rows], [len_q], [len_k], self.scale,
                                              prefixes=None if prefix is None else {0: prefix}, sliding_window=window)
            else:
                out[rows] = block_sparse_attention(q[rows], k_ctx, v_ctx, mask, block_size, self.scale, causal=True,
                                                   window=window)[0]
        return out

    def _context(self, layer, i, rows, len_k, k, v, k_cache, v_cache, ctx: Context, prefixes, window):
        """Keys and values of sequence i's context ``[len_k - first, Hkv, D]`` from ``first``: 0,
        or with a window the first token of the block it shows the chunk's first query (a block
        boundary): its prefix (read by its reader in ``prefixes``, or from ``layer``'s GPU tier, an
        fp8 cache's dequantized), then this chunk's rows."""
        num_prefix = len_k - (rows.stop - rows.start)
        if not num_prefix:
            return k[rows], v[rows]
        block_size = self.k_cache.shape[2]
        first = window_start(num_prefix, window) // block_size * block_size
        if i in prefixes:
            k_pre, v_pre = prefixes[i](first, num_prefix)
        else:
            scales = self.scales(layer)
            k_pre = gather_tokens(k_cache, ctx.block_tables[i], first, num_prefix, scales.get("k_scale"), k.dtype)
            v_pre = gather_tokens(v_cache, ctx.block_tables[i], first, num_prefix, scales.get("v_scale"), v.dtype)
        return torch.cat([k_pre.to(k.dtype), k[rows]]), torch.cat([v_pre.to(v.dtype), v[rows]])

    # ---- decode ------------------------------------------------------------------------
    def _tiered_decode(self, layer, q, ctx: Context, k_cache, v_cache) -> torch.Tensor:
        if ctx.selection is not None:
            return self._selected_decode(layer, q, ctx)
        tables, lens, starts, loads, _ = self._reads(layer, ctx)
        out, lse = decode_attention(q, k_cache, v_cache, tables, lens, self.scale, return_lse=True,
                                    context_starts=starts, **self.scales(layer))
        out, lse = self.ring.fold(layer, q, out, lse, self.scale)
        read = len(loads) * self.host.layer_block_bytes
        self.stats.add_comm(layer, False, read, read)
        return out.to(q.dtype)

    def _selected_decode(self, layer, q, ctx: Context) -> torch.Tensor:
        """The policy's picks at ``layer``, turned on the device into a gather of the missed host
        pages and per-head page tables over the GPU tier's rows; one paged read per group of
        sequences (one for the batch unless the staging pages are short), then the ring's blocks
        folded in. The policy's dense layers read every block, as FULL decode does."""
        selection = ctx.selection
        num_picks = 0
        if layer < self.policy.dense_layers:
            out, lse = decode_attention(q, self.k_cache[layer], self.v_cache[layer], ctx.block_tables,
                                        ctx.context_lens, self.scale, return_lse=True, **self.scales(layer))
        else:
            out, lse, num_picks = self._read_pages(layer, q, selection)
        if self.host is not None:  # a graph's step loads nothing through the ring
            out, lse = self.ring.fold(layer, q, out, lse, self.scale)
        if selection.counted:  # a graph's step is counted by the cache
            self.stats.add_reads(layer, selection.read_tokens(layer, num_picks), selection.context_tokens)
            if self.host is not None:
                self.stats.add_comm(layer, False, len(selection.ring_loads[layer]) * self.host.layer_block_bytes,
                                    selection.num_host_blocks * self.host.layer_block_bytes)
        return out.to(q.dtype)

    def _read_pages(self, layer, q, selection: DecodeSelection) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Attention of ``layer`` over the policy's pages: ``(out, lse, picks per KV head)``."""
        picks = self.policy.select_decode_pages(layer, selection.queries(q), selection.candidates)
        page, heads, dim = self.policy.page_size, self.k_rows.shape[2], self.k_rows.shape[3]
        k_pages, v_pages = (rows.view(-1, page, heads, dim) for rows in (self.k_rows, self.v_rows))
        scale_pages = None if self.k_scale_rows is None else tuple(
            rows.view(-1, page, heads) for rows in (self.k_scale_rows, self.v_scale_rows))
        scales = {} if scale_pages is None else {"k_scale": scale_pages[0], "v_scale": scale_pages[1]}
        if selection.in_batch_order:
            reads = self._gather_reads(layer, picks, 0, selection, k_pages, v_pages, scale_pages)
            out, lse = decode_attention(q, k_pages, v_pages, reads.tables, reads.lens, self.scale, return_lse=True,
                                        **scales)
            return out, lse, picks.shape[2]
        out = q.new_empty(q.shape, dtype=torch.float32)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
        for group, (_, batch_rows) in enumerate(selection.groups):
            reads = self._gather_reads(layer, picks, group, selection, k_pages, v_pages, scale_pages)
            group_out, group_lse = decode_attention(q[batch_rows], k_pages, v_pages, reads.tables, reads.lens,
                                                    self.scale, return_lse=True, **scales)
            out.index_copy_(0, batch_rows, group_out)
            lse.index_copy_(0, batch_rows, group_lse)
        return out, lse, picks.shape[2]

    def _gather_reads(self, layer, picks, group: int, selection: DecodeSelection, k_pages, v_pages, scale_pages):
        """``group``'s reads at ``layer`` (:meth:`DecodeSelection.layer_reads`), their missed host
        pages gathered into their rows and counted."""
        reads = selection.layer_reads(layer, picks, group, self.reuse)
        if self.host is not None and reads.src is not None:
            self.host.gather_pages(layer, reads.src, reads.heads, k_pages, v_pages, reads.dst, scale_pages)
            if not selection.counted:  # a graph's: counted on the device, replay by replay
                selection.count_host_reads(layer, reads)
            else:
                self.count_host_reads(layer, reads.host_reads, reads.misses)
        return reads

    def count_host_reads(self, layer: int, host_reads: torch.Tensor, misses: torch.Tensor):
        """``layer`` read ``host_reads`` host (page, KV head) pairs, ``misses`` of them gathered from
        the host tier (0-dim device tensors): the bytes loaded and, with a reuse cache, the reuse."""
        self.stats.add_comm(layer, False, misses * self.host.page_head_bytes(self.policy.page_size), 0)
        if self.reuse is not None:
            self.stats.add_reuse(layer, host_reads - misses, host_reads)
