"""Attention over a batch whose KV lives in two tiers.

    attention(seq) = attention over its GPU-tier blocks (paged kernels, with LSE)
                   + attention over its host-tier blocks (read through the ring), merged by LSE

- **Prefill** (chunks of several sequences): the chunk's KV is stored in the GPU tier; each chunk
  attends causally to itself and non-causally to its prefix. A prefix in the GPU tier is gathered
  through the block table as in GPU-only mode; a prefix with host blocks is gathered from both
  tiers (its host blocks copied H2D into the gathered buffer), so the kernels and the summation
  order are those of GPU-only mode. A block-sparse policy (XAttention) masks per sequence.
- **Decode**: paged decode attention over the GPU-resident blocks of the whole batch, returning
  the LSE when some sequence has host blocks; then those host blocks stream through the ring
  slots, each folded into its sequence's ``(out, lse)`` by one fused kernel
  (:func:`nanovllm.ops.decode_attend_merge`). The loads of a step form one plan across layers, so
  the ring keeps loading the next layer's blocks while this layer computes. A batch without host
  blocks and without a choosing policy is exactly GPU-only decode (and runs in CUDA graphs).
- **Decode with a choosing policy** (QUEST): per layer the policy picks each sequence's blocks in
  both tiers; the GPU-resident picks form the paged tables, the host picks the ring's loads.
"""
import torch

from nanovllm.kvcache.host_tier import HostTier
from nanovllm.ops import (block_sparse_attention, decode_attend_merge, decode_attention, gather_kvcache,
                          prefill_attention, store_kvcache)
from nanovllm.sparse import SparsePolicy, SparseStats
from nanovllm.sparse.stats import causal_visible_blocks
from nanovllm.utils.context import Context, PrefixGather, get_context
from nanovllm.utils.tensors import padded_rows, to_device


class RingReader:
    """Reads host blocks through the ring slots in the order of a plan of ``(layer, host block)``
    loads: load ``g`` goes to slot ``g % N`` and is issued as soon as that slot is free, so up to
    ``N`` loads are in flight, across layer boundaries."""

    def __init__(self, tier: HostTier):
        self.tier = tier
        self.plan: list[tuple[int, int]] = []
        self.issued = self.consumed = 0

    def reset(self, plan: list[tuple[int, int]]):
        """A new plan (a step's); its first loads start now."""
        self.plan, self.issued, self.consumed = list(plan), 0, 0
        self._issue()

    def extend(self, loads: list[tuple[int, int]]):
        self.plan += loads
        self._issue()

    def _issue(self):
        limit = min(len(self.plan), self.consumed + self.tier.num_slots)
        while self.issued < limit:
            layer, host_id = self.plan[self.issued]
            self.tier.load(self.issued % self.tier.num_slots, layer, host_id)
            self.issued += 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[block_size, Hkv, D]`` of the next planned load, once it landed."""
        return self.tier.wait(self.consumed % self.tier.num_slots)

    def done(self):
        """The block from :meth:`next` was read: its slot takes the next load."""
        self.tier.release(self.consumed % self.tier.num_slots)
        self.consumed += 1
        self._issue()


class TieredAttention:
    """Args: policy (the sparse policy), stats (where densities are counted), scale (softmax)."""

    def __init__(self, policy: SparsePolicy, stats: SparseStats, scale: float):
        self.policy, self.stats, self.scale = policy, stats, scale
        self.k_cache = self.v_cache = None
        self.host: HostTier | None = None
        self.ring: RingReader | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, host: HostTier | None):
        """The GPU tier ``[L, num_gpu_blocks, block_size, Hkv, D]`` (keys, values) and the host tier."""
        self.k_cache, self.v_cache, self.host = k_cache, v_cache, host
        self.ring = RingReader(host) if host is not None else None

    def release(self):
        self.k_cache = self.v_cache = self.host = self.ring = None

    def begin_step(self, ctx: Context):
        """Plan the step's ring loads: every layer reads ``ctx.host_loads`` (unless the policy
        chooses per layer), so the whole step is one plan."""
        if self.ring is not None:
            plan = [] if ctx.selection is not None else [(layer, host_id) for layer in range(self.k_cache.shape[0])
                                                          for _, host_id in ctx.host_loads]
            self.ring.reset(plan)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one layer: q ``[N, Hq, D]``, k, v ``[N, Hkv, D]`` (the batch's new
        tokens, packed) -> ``[N, Hq, D]``; stores k, v in the GPU tier first."""
        ctx = get_context()
        if ctx.slot_mapping is None:  # the cache is not touched: warm-up, scoring
            return self._prefill(layer, q, k, v, ctx, None, None)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self._prefill(layer, q, k, v, ctx, k_cache, v_cache)
        if ctx.paged_only:
            return decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale)
        return self._tiered_decode(layer, q, ctx, k_cache, v_cache)

    # ---- prefill -----------------------------------------------------------------------
    def _prefill(self, layer, q, k, v, ctx: Context, k_cache, v_cache) -> torch.Tensor:
        prefixes = {i: self._gather_prefix(layer, g) for i, g in ctx.prefix_gathers.items()}
        if prefixes:
            read = sum(len(g.host) for g in ctx.prefix_gathers.values())
            self.stats.add_comm(layer, True, read, read)
        if self.policy.dense_prefill:
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale, k_cache, v_cache,
                                     ctx.block_tables, prefixes)
        return self._sparse_prefill(layer, q, k, v, ctx, k_cache, v_cache, prefixes)

    def _gather_prefix(self, layer: int, gather: PrefixGather) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's keys and values ``[num_tokens, Hkv, D]``, from both tiers."""
        block_size = self.k_cache.shape[2]
        shape = (-(-gather.num_tokens // block_size), *self.k_cache.shape[2:])
        out = [torch.empty(shape, dtype=self.k_cache.dtype, device=self.k_cache.device) for _ in range(2)]
        for buf, cache in zip(out, (self.k_cache, self.v_cache)):
            buf[gather.gpu_index] = cache[layer][gather.gpu_ids]
        for index, host_id in gather.host:
            self.host.read_block(layer, host_id, out[0][index], out[1][index])
        return out[0].flatten(0, 1)[:gather.num_tokens], out[1].flatten(0, 1)[:gather.num_tokens]

    def _sparse_prefill(self, layer, q, k, v, ctx: Context, k_cache, v_cache, prefixes) -> torch.Tensor:
        """Per sequence: the policy's mask over its whole context, then block-sparse attention
        (or dense attention of the whole batch when no sequence is masked)."""
        block_size, heads = self.policy.prefill_block_size, q.shape[1]
        work, start = [], 0
        for i, (len_q, len_k) in enumerate(zip(ctx.seqlens_q, ctx.seqlens_k)):
            rows, start = slice(start, start + len_q), start + len_q
            if not len_q:
                continue
            k_ctx, v_ctx = self._context(i, rows, len_k, k, v, k_cache, v_cache, ctx, prefixes)
            mask = self.policy.prefill_mask(q[rows], k_ctx)
            visible = heads * causal_visible_blocks(len_q, len_k, block_size)
            self.stats.add_compute(layer, visible if mask is None else mask.sum(), visible)
            work.append((rows, k_ctx, v_ctx, mask))
        if all(mask is None for *_, mask in work):
            return prefill_attention(q, k, v, ctx.seqlens_q, ctx.seqlens_k, self.scale, k_cache, v_cache,
                                     ctx.block_tables, prefixes)
        out = torch.empty_like(q)
        for rows, k_ctx, v_ctx, mask in work:
            len_q, len_k = q[rows].shape[0], k_ctx.shape[0]
            if mask is None:
                prefix = {0: (k_ctx[:len_k - len_q], v_ctx[:len_k - len_q])} if len_k > len_q else None
                out[rows] = prefill_attention(q[rows], k[rows], v[rows], [len_q], [len_k], self.scale, prefixes=prefix)
            else:
                out[rows] = block_sparse_attention(q[rows], k_ctx, v_ctx, mask, block_size, self.scale, causal=True)[0]
        return out

    @staticmethod
    def _context(i, rows, len_k, k, v, k_cache, v_cache, ctx: Context, prefixes):
        """Keys and values of sequence i's whole context ``[len_k, Hkv, D]``: its prefix (from
        ``prefixes`` or the GPU tier), then this chunk's rows."""
        num_prefix = len_k - (rows.stop - rows.start)
        if not num_prefix:
            return k[rows], v[rows]
        if i in prefixes:
            k_pre, v_pre = prefixes[i]
        else:
            k_pre = gather_kvcache(k_cache, ctx.block_tables[i], num_prefix)
            v_pre = gather_kvcache(v_cache, ctx.block_tables[i], num_prefix)
        return torch.cat([k_pre.to(k.dtype), k[rows]]), torch.cat([v_pre.to(v.dtype), v[rows]])

    # ---- decode ------------------------------------------------------------------------
    def _tiered_decode(self, layer, q, ctx: Context, k_cache, v_cache) -> torch.Tensor:
        if ctx.selection is None:
            tables, lens, loads = ctx.block_tables, ctx.context_lens, ctx.host_loads
        else:
            tables, lens, loads = self._select(layer, q, ctx)
            self.ring.extend([(layer, host_id) for _, host_id in loads])
        out, lse = decode_attention(q, k_cache, v_cache, tables, lens, self.scale, return_lse=True)
        for row, _ in loads:
            k_block, v_block = self.ring.next()
            decode_attend_merge(q[row], k_block, v_block, out[row], lse[row], self.scale)
            self.ring.done()
        if ctx.host_loads:
            self.stats.add_comm(layer, False, len(loads), len(ctx.host_loads))
        return out.to(q.dtype)

    def _select(self, layer, q, ctx: Context):
        """The policy's picks at ``layer``: GPU-tier tables and lengths of the picked resident
        blocks (device tensors) and the picked host blocks ``(row, host block)``."""
        selection, block_size = ctx.selection, self.k_cache.shape[2]
        picks = dict(zip(selection.blocks.rows,
                         self.policy.select_decode_blocks(layer, q[selection.blocks.rows], selection.blocks)))
        tables, lens, loads = [], [], []
        for row, (gpu_table, host_table, length) in enumerate(selection.tables):
            indices = picks.get(row, range(len(gpu_table)))
            resident = [gpu_table[j] for j in indices if gpu_table[j] >= 0]
            loads += [(row, host_table[j]) for j in indices if host_table[j] >= 0]
            tables.append(resident)
            lens.append(length - (len(gpu_table) - len(resident)) * block_size)
        width = max(map(len, tables))
        return (to_device(padded_rows(tables, width), torch.int32, q.device),
                to_device(lens, torch.int32, q.device), loads)
