"""The KV cache of one rank: the one place that knows the tiers exist.

    cache = KVCache(config, attention_layers, device)   binds itself to every attention layer
    cache.set_key_offsets(offsets)                      an fp8 cache's key offsets (key_offset.py), before allocate
    cache.host_blocks(ranks_on_host)                    host-tier size (0 without the host tier)
    cache.allocate(sizes)                               GPU tier, host tier (enable_cpu_offload; its first chunk pinned), metadata
    cache.start_pinning()                               the rest of the host tier pinned in the background
    each step: cache.begin_step(moves) -> cache.prepare(seqs, is_prefill) -> model -> cache.finish_step()

The GPU tier is ``[2, L, num_gpu_blocks + reuse rows, block_size, Hkv, D]`` (keys, values) read
in place by the paged kernels, its last blocks of each layer the decode reuse cache's rows, followed
in memory by the staging rows that all layers share (``tier_rows.py``: with a host tier and a choosing
policy, decode addresses the whole as one table of rows); the host tier (``host_tier.py``) holds
spilled and evicted blocks in host memory pinned on demand (``host_memory.py``).
Which block lives where is the block manager's business (``block_manager.py``, on the scheduler's
side); a step carries it here as each sequence's two block tables and the list of moves between
the tiers (``eviction.py``: spills, write-backs, load-backs). The
attention over both tiers is ``tiered_attention.py``, a step's inputs are built by
``step_inputs.py``; the sparse policy only chooses (``nanovllm.sparse``). With the host tier off,
every step is the GPU-only engine's: same tables, same kernels. Whether the host tier exists is
``Config.enable_cpu_offload``, read once here (:attr:`KVCache.tiered`); a host tier always has
blocks (``sizing.check_capacity``).
"""
import logging

import torch

from nanovllm.config import Config
from nanovllm.kvcache import sizing
from nanovllm.kvcache.sizing import KVGeometry, TierSizes
from nanovllm.sequence import Sequence
from nanovllm.kvcache.block_manager import NO_BLOCK, BlockManager
from nanovllm.kvcache.eviction import BlockMove
from nanovllm.kvcache.host_tier import HostTier
from nanovllm.kvcache.tiered_attention import TieredAttention
from nanovllm.kvcache.reuse import ReuseCache, reuse_cache_rows
from nanovllm.kvcache.tier_rows import TierRows, staging_rows
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.sparse import SparseStats, create_policy
from nanovllm.kvcache.context import reset_context, set_context
from nanovllm.kvcache.spec import uniform_storage
from nanovllm.kvcache.step_inputs import StepInputs
from nanovllm.kvcache.window import widest_window, window_start
from nanovllm.ops.kv_quant import SCALE_DTYPE, dequantize
from nanovllm.utils.ints import cdiv
from nanovllm.utils.tensors import to_device

logger = logging.getLogger(__name__)

CHOOSING_GRAPH_SEQS = 32
"""The largest decode batch whose choosing decode is captured in CUDA graphs (their temporaries
grow with the batch times the candidate pages of ``max_model_len``)."""


class KVCache:
    """Args: config; layers (the model's attention layers, in order, each declaring its
    :class:`~nanovllm.kvcache.spec.LayerKVSpec`); device; decode_batch_sizes
    (CUDA: the captured CUDA-graph batch sizes, to which paged-only decode batches are padded so
    that eager and graph decode run the same shapes; None: no padding); decode_graphs (the runner
    captures decode CUDA graphs: the choosing policy's steps get graphs of their own,
    :attr:`choosing_graph_sizes`)."""

    def __init__(self, config: Config, layers: list, device: torch.device, decode_batch_sizes=None,
                 decode_graphs: bool = False):
        self.config, self.device = config, device
        layer = layers[0]
        self.specs = [module.kv_spec(config.dtype, config.kv_storage_dtype) for module in layers]
        self.storage = storage = uniform_storage(self.specs)
        self.geometry = KVGeometry(len(layers), storage.num_kv_heads, storage.head_dim, config.kvcache_block_size,
                                   storage.cache_dtype, storage.token_bytes)
        self.tiered = config.enable_cpu_offload
        self.num_ring_slots = sizing.ring_slots(config.num_ring_slots, self.geometry) if self.tiered else 0
        self.windows = [spec.sliding_window for spec in self.specs]
        self.release_window = widest_window(self.windows)
        self.policy = create_policy(config, layer.scale)
        self.chooses = self.policy.chooses_decode_pages and all(w is None for w in self.windows)
        if self.policy.chooses_decode_pages and not self.chooses:
            logger.warning("sparse_policy=%r reads every page of each layer's sliding window (choosing pages inside "
                           "a window is not supported)", config.sparse_policy)
        self.choosing_graph_sizes = self._choosing_graph_sizes(decode_batch_sizes if decode_graphs else None)
        self.inputs = StepInputs(config.kvcache_block_size, device, self.tiered, decode_batch_sizes,
                                 config.max_model_len, self.windows, self.choosing_graph_sizes)
        picks_from_host = self.tiered and self.chooses
        self.reuse_rows = reuse_cache_rows(config) if picks_from_host else 0
        self.staging_rows = staging_rows(config) if picks_from_host else 0
        self.stats = SparseStats()
        self.attention = TieredAttention(self.policy, self.stats, layer.scale, self.specs)
        for i, module in enumerate(layers):
            module.layer_id, module.kv_cache = i, self
        self.kv: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # an fp8 cache's [2, L, layer_rows, block_size, Hkv]
        self.layout: TierRows | None = None
        self.host: HostTier | None = None
        self.num_gpu_blocks = 0
        self._completed: list[int] = []  # GPU blocks with a page filled by the step (the policy's metadata)
        self._graph_host_counts: torch.Tensor | None = None  # [2, L]: the choosing graphs' host reads, misses
        self._graph_counts_pending = False  # a replayed step added to them since they were last taken

    def _choosing_graph_sizes(self, decode_batch_sizes: list[int] | None) -> list[int]:
        """The batch sizes whose decode with the choosing policy is captured in CUDA graphs: the
        captured sizes (None: no graphs) up to :data:`CHOOSING_GRAPH_SEQS`, when the policy allows
        it (``choice_in_graphs``), reads no layer whole (with a host tier: no ring in the graph) and
        a sequence of ``max_model_len`` tokens has more candidate pages than the budget (else none
        ever chooses). With a host tier the graphs gather host pages too."""
        policy, config = self.policy, self.config
        if not (decode_batch_sizes and self.chooses and policy.choice_in_graphs
                and not (self.tiered and policy.dense_layers)):
            return []
        pages = cdiv(config.max_model_len, config.kvcache_block_size) * (config.kvcache_block_size // policy.page_size)
        return [s for s in decode_batch_sizes if s <= CHOOSING_GRAPH_SEQS] if policy.selects(pages) else []

    def graph_selection(self, batch: int) -> DecodeSelection:
        """The fixed-shape selection of the choosing graphs of ``batch`` rows
        (:meth:`DecodeSelection.for_graphs`), over the allocated cache."""
        if self.tiered and self._graph_host_counts is None:  # the graphs gather host pages
            self._graph_host_counts = torch.zeros(2, self.geometry.num_layers, dtype=torch.int64, device=self.device)
        return DecodeSelection.for_graphs(self.policy, batch, self.config.max_model_len, self.layout,
                                          self.geometry.block_size, self.geometry.num_kv_heads, self.device,
                                          host_counts=self._graph_host_counts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate=None) -> torch.Tensor:
        """Attention of one layer for the current step (see ``tiered_attention.py``)."""
        return self.attention.forward(layer, q, k, v, rotate)

    def set_key_offsets(self, offsets: torch.Tensor):
        """An fp8 cache's key offsets (``key_offset.py``): float32 ``[L, Hkv, D]``, kept in the
        model's dtype (any constant is exact: its rounding does not matter) and subtracted from
        every key stored; set once, before :meth:`allocate` (no key is stored yet, no CUDA graph
        captured).

        Raises:
            ValueError: a cache that is not fp8, or offsets of another shape or dtype.
            RuntimeError: the cache is allocated already.
        """
        g = self.geometry
        shape = (g.num_layers, g.num_kv_heads, g.head_dim)
        if not self.storage.scaled:
            raise ValueError(f"key offsets belong to an fp8 cache; this one stores {self.storage.cache_dtype}")
        if tuple(offsets.shape) != shape or offsets.dtype != torch.float32:
            raise ValueError(f"key offsets must be float32 {shape}; got {offsets.dtype} {tuple(offsets.shape)}")
        if self.kv is not None:
            raise RuntimeError("key offsets are set before the cache is allocated (keys stored already would keep "
                               "the old ones)")
        self.attention.set_key_offsets(offsets.to(self.device, self.storage.dtype))
        logger.info("fp8 KV: keys stored minus their calibrated mean per (layer, KV head, channel); the largest "
                    "offset %.3g", offsets.abs().max().item())

    # ---- memory ------------------------------------------------------------------------
    def metadata_bytes_per_block(self) -> int:
        g = self.geometry
        return self.policy.metadata_bytes_per_block(g.num_layers, g.block_size, g.num_kv_heads, g.head_dim,
                                                    self.storage.dtype)

    def host_blocks(self, ranks_on_host: int) -> int:
        """Host-tier blocks of this rank (``sizing.host_blocks``); 0 without the host tier."""
        return sizing.host_blocks(self.config, self.geometry, ranks_on_host) if self.tiered else 0

    def reserved_bytes(self, num_host_blocks: int) -> int:
        """Device bytes the cache needs besides its GPU blocks: ring slots, host-block metadata,
        the reuse cache's rows, the staging rows (a ring slot, a staging row: one layer of a block)."""
        if not self.tiered:
            return 0
        return (self.num_ring_slots * self.geometry.layer_block_bytes + self._decode_rows_bytes()
                + num_host_blocks * self.metadata_bytes_per_block())

    def _decode_rows_bytes(self) -> int:
        """Bytes of the reuse cache's rows (one per layer each) and the staging rows (one layer each)."""
        g = self.geometry
        return self.reuse_rows * g.block_bytes + self.staging_rows * g.layer_block_bytes

    def allocate(self, sizes: TierSizes):
        """Allocate both tiers and the policy's metadata.

        Raises:
            RuntimeError: the GPU tier or the host tier cannot be allocated (with the byte counts).
        """
        g, cuda = self.geometry, self.device.type == "cuda"
        self.layout = TierRows(g.num_layers, sizes.gpu_blocks + self.reuse_rows, self.staging_rows)
        shape = (2, self.layout.total, g.block_size, g.num_kv_heads, g.head_dim)
        try:  # on CPU untouched pages cost nothing: every slot is written before it is read
            rows = (torch.zeros if cuda else torch.empty)(shape, dtype=g.cache_dtype, device=self.device)
            scale_rows = (torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
                          if self.storage.scaled else None)
        except RuntimeError as err:
            parts = f"num_kvcache_blocks={sizes.gpu_blocks}"
            if self.reuse_rows or self.staging_rows:
                parts += (f" + {self.reuse_rows} reuse-cache rows (num_reuse_cache_blocks) + {self.staging_rows} "
                          f"staging rows / {g.num_layers} layers")
            total = sizes.gpu_blocks * g.block_bytes + self._decode_rows_bytes()
            raise RuntimeError(f"cannot allocate the KV cache: ({parts}) x {g.block_bytes} bytes = "
                               f"{total / 2**30:.1f} GiB on {self.device}: {err}") from err
        if self.tiered:
            self.host = HostTier(g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.cache_dtype, self.device,
                                 sizes.host_blocks, self.num_ring_slots, scaled=self.storage.scaled)
            # every layer's first host block lies in chunk 0: the first spill writes into it (so no step
            # waits for it) and captured gathers read it (registered before any capture: host_memory.py)
            self.host.memory.pin_first_chunk()
        self.kv = self.layout.per_layer(rows)
        self.kv_scales = None if scale_rows is None else self.layout.per_layer(scale_rows)
        self.num_gpu_blocks = sizes.gpu_blocks
        reuse = ReuseCache(g.num_layers, g.num_kv_heads, self.reuse_rows, sizes.gpu_blocks, self.layout.layer_rows,
                           g.block_size // self.policy.page_size, self.device) if self.reuse_rows else None
        self.attention.bind(rows, self.layout, self.host, reuse, scale_rows)
        self.policy.allocate(g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, self.storage.dtype, self.device,
                             sizes.gpu_blocks, sizes.host_blocks)
        self._log(sizes)

    def _log(self, sizes: TierSizes):
        g = self.geometry
        tiers = [("GPU", sizes.gpu_blocks)] + ([("host", sizes.host_blocks)] if self.host else [])
        pinned = "" if self.host is None else (
            f" (host capacity {self.host.memory.capacity_bytes / 2**30:.2f} GiB, pinned now "
            f"{self.host.memory.bytes_pinned / 2**30:.2f} GiB, then on demand in chunks of "
            f"{self.host.memory.chunk_blocks} blocks)")
        logger.info("KV cache: %s%s; %d-token blocks of %d layers, kv_cache_dtype=%r (%s, %d bytes per token and "
                    "layer%s)%s", ", ".join(f"{name} tier {n} blocks = {n * g.block_size} tokens "
                                            f"({n * g.block_bytes / 2**30:.2f} GiB)" for name, n in tiers),
                    pinned, g.block_size, g.num_layers, self.config.kv_cache_dtype, g.cache_dtype, g.token_bytes,
                    ", scales per (token, KV head) included" if self.storage.scaled else "",
            f", {self.num_ring_slots} ring slots, policy {self.config.sparse_policy}, "
            f"{self.reuse_rows} reuse-cache blocks ({self.reuse_rows * g.block_bytes / 2**30:.2f} GiB), "
            f"{self.staging_rows} staging rows ({self.staging_rows * g.layer_block_bytes / 2**30:.2f} GiB)"
            if self.host else "")

    def block_manager(self, sizes: TierSizes) -> BlockManager:
        """The scheduler's block manager for tiers of ``sizes``: this cache's block size, with a
        sliding window in every layer the widest (its running sequences release the blocks before
        it, ``block_manager.py``), and with a host tier the write-backs ahead of reuse of as many
        registered free GPU blocks as one step can take (``max_num_batched_tokens`` in blocks, and
        a block per sequence), into host blocks already pinned (no step waits for them)."""
        block_size = self.geometry.block_size
        step_blocks = cdiv(self.config.max_num_batched_tokens, block_size) + self.config.max_num_seqs
        ready = None if self.host is None else lambda: self.host.memory.pinned_blocks
        return BlockManager(sizes.gpu_blocks, block_size, sizes.host_blocks, release_window=self.release_window,
                            write_ahead_blocks=step_blocks, host_blocks_ready=ready)

    def start_pinning(self):
        """Pin the rest of the host tier's memory in the background (after the CUDA graphs are
        captured: ``host_memory.py``; the first chunk is pinned by :meth:`allocate`); a no-op
        without a host tier."""
        if self.host is not None:
            self.host.memory.start()

    def release(self):
        """Free both tiers (the host tier's memory unpinned)."""
        self._take_graph_counts()  # the statistics stay readable after release
        self._graph_host_counts = None
        if self.host is not None:  # allocated (release may follow a failed allocate)
            self.host.free_memory()
        self.attention.release()
        self.kv = self.kv_scales = self.host = None

    # ---- steps -------------------------------------------------------------------------
    def begin_step(self, moves: list[BlockMove]):
        """Copy the blocks the scheduler moved between the tiers (``eviction.BlockMove``: spills,
        write-backs, load-backs, in order) before anything of this step touches the GPU tier; the
        policy's metadata follows them; the reuse cache forgets the pages of the host blocks
        rewritten."""
        if self.host is not None:
            self.host.wait_ahead()
        if not moves:
            return
        self.host.move(moves, self.kv[0], self.kv[1], None if self.kv_scales is None else tuple(self.kv_scales))
        rewritten = [m.host for m in moves if m.to_host]
        if rewritten:
            self.attention.forget_host_blocks(to_device(rewritten, torch.int64, self.device))
        if self.policy.needs_block_metadata:
            self._move_metadata(moves)

    def _move_metadata(self, moves: list[BlockMove]):
        """The policy's metadata copied as the blocks were, in order: one call per run of moves
        of one direction with no repeated destination."""
        run, destinations = [], set()
        for move in [*moves, None]:
            if run and (move is None or move.to_host != run[0].to_host
                        or (move.host if move.to_host else move.gpu) in destinations):
                gpu_ids = to_device([m.gpu for m in run], torch.int64, self.device)
                host_ids = to_device([m.host for m in run], torch.int64, self.device)
                if run[0].to_host:
                    self.policy.on_spill(gpu_ids, host_ids)
                else:
                    self.policy.on_load(host_ids, gpu_ids)
                run, destinations = [], set()
            if move is not None:
                run.append(move)
                destinations.add(move.host if move.to_host else move.gpu)

    def prepare(self, seqs: list[Sequence], is_prefill: bool):
        """Set the attention context of a step; returns the model inputs ``(input_ids,
        positions, sample_idx)`` (``sample_idx``: the rows whose logits are sampled)."""
        if is_prefill:
            ctx, input_ids, positions, sample_idx = self.inputs.prefill(seqs)
            for seq in seqs:
                self._note_filled(seq, seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens)
        else:
            ctx, input_ids, positions, sample_idx = self.inputs.decode(seqs, self._selection(seqs))
            for seq in seqs:
                self._note_filled(seq, len(seq) - 1, len(seq))
            if self.counts_decode_reads and ctx.selection is None:
                self._count_window_reads(seqs)
            elif ctx.selection is not None and ctx.graph_batch:  # a graph's layers count nothing
                self._count_selected_reads(ctx.selection)
        set_context(ctx)
        self.attention.begin_step(ctx)
        return (to_device(input_ids, torch.int64, self.device), to_device(positions, torch.int64, self.device),
                sample_idx)

    def finish_step(self):
        """After the forward: the policy's metadata of the blocks whose pages the step filled."""
        reset_context()
        if self._completed:
            ids = to_device(self._completed, torch.int64, self.device)
            keys = self.kv[0][:, ids]  # [L, n, block_size, Hkv, D]
            if self.kv_scales is not None:  # a layer at a time: float32 temporaries of one layer only
                scales, stored = self.kv_scales[0][:, ids], keys
                keys = torch.empty(stored.shape, dtype=self.storage.dtype, device=stored.device)
                for layer in range(stored.shape[0]):
                    keys[layer] = dequantize(stored[layer], scales[layer], self.storage.dtype)
            self.policy.on_pages_full(keys.to(self.storage.dtype), ids)
            self._completed = []

    def _note_filled(self, seq: Sequence, start: int, end: int):
        """Positions ``start .. end - 1`` of ``seq`` are written this step: the GPU blocks whose
        pages (``policy.page_size`` tokens, the block without one) they fill get the policy's
        metadata after the step."""
        if self.policy.needs_block_metadata:
            block_size = self.geometry.block_size
            page = self.policy.page_size or block_size
            blocks = dict.fromkeys(p * page // block_size for p in range(start // page, end // page))
            self._completed += [seq.block_table[j] for j in blocks if seq.block_table[j] != NO_BLOCK]

    @property
    def counts_decode_reads(self) -> bool:
        """Decode's reads are counted (``SparseStats.add_reads``): the policy chooses decode
        pages, or some layer has a sliding window (it reads only the window's tokens)."""
        return self.policy.chooses_decode_pages or any(w is not None for w in self.windows)

    def _count_window_reads(self, seqs: list[Sequence]):
        """A decode step without a selection: each layer reads the tokens its window shows (every
        token without one) of its sequences' contexts."""
        tokens = sum(len(seq) for seq in seqs)
        for layer, window in enumerate(self.windows):
            read = sum(len(seq) - window_start(len(seq) - 1, window) for seq in seqs)
            self.stats.add_reads(layer, read, tokens)

    def _count_selected_reads(self, selection: DecodeSelection):
        """What each layer of a replayed choosing step reads, as its eager layers count it (the
        host pages it gathers are counted on the device, :meth:`sparse_stats`)."""
        available = 0 if self.host is None else selection.num_host_blocks * self.host.layer_block_bytes
        self._graph_counts_pending = self.host is not None
        for layer in range(self.geometry.num_layers):
            self.stats.add_reads(layer, selection.read_tokens(layer, selection.num_picks(layer)),
                                 selection.context_tokens)
            if self.host is not None:
                self.stats.add_comm(layer, False, 0, available)

    def _selection(self, seqs: list[Sequence]) -> DecodeSelection | None:
        """The batch's choosing part, when the policy chooses for some sequence (its reads are
        counted by the attention, or for a replayed step by :meth:`prepare`)."""
        if not self.chooses:
            return None
        return DecodeSelection.build(self.policy, [(seq.block_table, seq.host_block_table, len(seq)) for seq in seqs],
                                     self.layout, self.num_gpu_blocks, self.geometry.block_size,
                                     self.geometry.num_kv_heads, self.device)

    # ---- observability -----------------------------------------------------------------
    def sparse_stats(self) -> SparseStats:
        """The sparse statistics (with the host reads the choosing graphs counted on the device)."""
        self._take_graph_counts()
        return self.stats

    def _take_graph_counts(self):
        """Add the host reads the choosing graphs counted on the device since the last call."""
        if not self._graph_counts_pending:
            return
        counts = self._graph_host_counts.clone()
        self._graph_host_counts.zero_()
        self._graph_counts_pending = False
        for layer in range(self.geometry.num_layers):
            self.attention.count_host_reads(layer, counts[0, layer], counts[1, layer])

    def usage(self) -> dict:
        """``loaded_blocks``: host-to-GPU reads so far (ring loads, gathers, load-backs), in blocks
        of every layer (keys and values), pages gathered included (syncs with the device once);
        ``host_bytes_pinned``: host-tier bytes pinned now; ``kv_cache_dtype``: the option's value
        (a str); ``saturated_values``: key and value elements clamped to the fp8 range when stored
        (only static checkpoint scales clamp: 0 with dynamic ones and without fp8; syncs);
        ``gpu_tokens``, ``host_tokens``: the tokens each tier holds (blocks x block size);
        ``ring_slots``: the host tier's ring slots (``Config.num_ring_slots`` resolved). Plain ints
        besides the dtype; 0 for the host tier's counts without a host tier."""
        g, saturated = self.geometry, self.attention.saturated
        stats = {"kv_cache_dtype": self.config.kv_cache_dtype,
                 "saturated_values": 0 if saturated is None else int(saturated.item()),
                 "gpu_tokens": self.num_gpu_blocks * g.block_size,
                 "host_tokens": 0 if self.host is None else self.host.num_blocks * g.block_size,
                 "ring_slots": self.num_ring_slots}
        if not self.tiered:
            return {"loaded_blocks": 0, "host_bytes_pinned": 0, **stats}
        return {"loaded_blocks": self.host.loaded_bytes() // g.block_bytes,
                "host_bytes_pinned": self.host.memory.bytes_pinned, **stats}
