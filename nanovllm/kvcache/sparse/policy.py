"""The sparse-policy interface and the ring-buffer pipeline every policy shares.

In offload mode an attention layer hands each prefill chunk and each decode step to a
``SparsePolicy``. The base class owns the pipeline, written once:

    select blocks -> load the first N into the N ring slots (one transfer stream each)
    for each block: wait slot ready -> fold the block into the running (out, lse) state
                    -> record compute done -> load the block N ahead into the freed slot

Folding is attention with LSE plus a log-sum-exp merge: for a prefill chunk two steps
(``attend_block``, then ``merge_attention_outputs``), for a decode query one fused kernel
(``decode_attend_merge``). In decode, a policy whose block choice does not depend on the query
lets the layer prefetch the next call's first N blocks as soon as a call has issued its last
load, so the copy engine keeps streaming across sequence and layer boundaries while the host runs
the rest of the layer; a query-dependent policy prefetches the blocks it always loads
(``blocks_before_query``).

A policy changes *which* blocks are loaded (``select_blocks``) and may keep metadata through the
offload hooks; block-sparse prefill policies may also override the per-block attention.
"""
import functools
from abc import ABC
from dataclasses import dataclass, field
from enum import Enum

import torch

from nanovllm.kvcache.sparse.stats import SparseStats
from nanovllm.ops import decode_attend_merge, flash_attn_with_lse, merge_attention_outputs, prefill_attention


class SparsePolicyType(Enum):
    FULL = "FULL"
    QUEST = "QUEST"
    XATTN_BSA = "XATTN_BSA"

    @classmethod
    def parse(cls, value) -> "SparsePolicyType":
        """From a member or its name (case-insensitive). Raises ValueError naming the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(f"sparse_policy must be one of {[m.value for m in cls]}, got {value!r}") from None


@dataclass
class PolicyContext:
    """What a policy knows about one sequence at one layer.

    Attributes:
        layer_id: the attention layer.
        cpu_blocks: CPU block ids of the sequence's earlier KV, in position order (for prefill,
            the blocks of previous chunks; for decode, every offloaded block).
        block_lens: valid tokens in each of ``cpu_blocks`` (the last prefill block may be partial;
            its length is the prefill length recorded at prefill time).
        is_prefill: prefill chunk or decode step.
        chunk_block: prefill only, the CPU block the current chunk is offloaded to.
        decode_row: decode only, the sequence's decode-buffer row.
        decode_len: decode only, tokens in the decode buffer including the current one.
    """

    layer_id: int
    cpu_blocks: list[int]
    block_lens: list[int]
    is_prefill: bool
    chunk_block: int = -1
    decode_row: int = -1
    decode_len: int = 0
    extra: dict = field(default_factory=dict)


class SparsePolicy(ABC):
    """Base policy: full attention over the blocks that ``select_blocks`` returns.

    Subclasses override ``select_blocks`` (and the hooks) and set ``supports_prefill`` /
    ``supports_decode``. Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v
    ``[num_tokens, num_kv_heads, head_dim]``; outputs like q.
    """

    supports_prefill = True
    supports_decode = True
    dense_prefill = True
    """Prefill attends to every causally visible key (compute density 1.0, not counted)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.stats = SparseStats()

    # ---- hooks -------------------------------------------------------------------------
    def initialize(self, offload_engine) -> None:
        """Called once the offload engine exists (allocate per-block metadata here)."""

    def on_prefill_offload(self, cpu_block: int, layer_id: int, k: torch.Tensor, num_tokens: int) -> None:
        """A prefill chunk's keys ``k [num_tokens, Hkv, D]`` of ``layer_id`` go to ``cpu_block``."""

    def on_decode_offload(self, cpu_block: int, k_layers: torch.Tensor) -> None:
        """A full decode block's keys of every layer ``[num_layers, block_size, Hkv, D]`` go to
        ``cpu_block``."""

    def reset(self) -> None:
        """Forget per-request state (the engine calls it when a request's blocks are freed)."""

    def select_blocks(self, available: list[int], offload_engine, ctx: PolicyContext,
                      q: torch.Tensor) -> list[int]:
        """Indices into ``ctx.cpu_blocks`` to attend to, in increasing order. Default: all."""
        return available

    # ---- the shared pipeline -----------------------------------------------------------
    def compute_chunked_prefill(self, q, k, v, offload_engine, ctx: PolicyContext) -> torch.Tensor:
        """Attention of a prefill chunk: causal over the chunk itself, non-causal over the
        selected earlier blocks streamed through the ring buffer, merged by LSE. Also stores the
        chunk's KV in the layer's prefill buffer and offloads it asynchronously."""
        if not self.supports_prefill:
            raise RuntimeError(f"{type(self).__name__} does not support prefill")
        k_buf, v_buf = offload_engine.write_prefill_buffer(ctx.layer_id, k, v)
        out, lse = self.attend_chunk(q.unsqueeze(0), k_buf, v_buf, offload_engine, ctx)
        offload_engine.offload_prefill_buffer_async(ctx.layer_id, ctx.chunk_block, k.size(0))
        self.on_prefill_offload(ctx.chunk_block, ctx.layer_id, k_buf, k.size(0))
        out, lse = self._attend_cpu_blocks(q.unsqueeze(0), (out, lse), offload_engine, ctx)
        return out.squeeze(0)

    def compute_chunked_decode(self, q, offload_engine, ctx: PolicyContext) -> torch.Tensor:
        """Attention of one decode query ``q [1, Hq, D]``: the decode buffer (current token
        included) plus the selected offloaded blocks, merged by LSE."""
        if not self.supports_decode:
            raise RuntimeError(f"{type(self).__name__} does not support decode")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        k_buf, v_buf = offload_engine.decode_buffer(ctx.layer_id, ctx.decode_row, ctx.decode_len)
        decode_attend_merge(q[0], k_buf, v_buf, out[0], lse[0], self.scale)
        self._attend_cpu_blocks(q.unsqueeze(0), (out[0], lse[0]), offload_engine, ctx)
        return out.to(q.dtype)

    def blocks_before_query(self, ctx: PolicyContext) -> list[int]:
        """Indices into ``ctx.cpu_blocks`` that a decode call will load whatever its query,
        known before the query exists. Default: the whole selection (it ignores the query)."""
        return self.select_blocks(list(range(len(ctx.cpu_blocks))), None, ctx, None)

    def prefetch(self, offload_engine, ctx: PolicyContext) -> None:
        """Start loading, into slots 0, 1, ..., the first N (N = ring slots) blocks that the
        attention call described by ``ctx`` will load whatever its query, before that query
        exists: for a decode step the start of ``blocks_before_query``; for a prefill chunk every
        earlier block in order when prefill is dense (a block-sparse prefill selects with the
        chunk's queries: nothing). The call takes them through ``reuse_prefetch``."""
        if ctx.is_prefill:
            known = list(range(len(ctx.cpu_blocks))) if self.dense_prefill else []
        else:
            known = self.blocks_before_query(ctx)
        for slot, index in enumerate(known[:offload_engine.num_slots]):
            offload_engine.prefetch_to_slot_layer(slot, ctx.layer_id, ctx.cpu_blocks[index])

    @staticmethod
    def _prefetched_first(chosen: list[int], engine, ctx: PolicyContext) -> list[int]:
        """``chosen`` with the blocks already prefetched for this call first, in slot order (so
        the one in slot j is the j-th to load); the LSE merge does not depend on the order."""
        slot_of = engine.prefetched_slots(ctx.layer_id)
        ahead = sorted((i for i in chosen if ctx.cpu_blocks[i] in slot_of), key=lambda i: slot_of[ctx.cpu_blocks[i]])
        return ahead + [i for i in chosen if ctx.cpu_blocks[i] not in slot_of]

    def _attend_cpu_blocks(self, q, state, engine, ctx: PolicyContext, visit=None):
        """N-way pipeline over the selected CPU blocks (N = ring slots), folded into ``state``
        (``(out, lse)``; see ``_fold_block``). Returns the final state.

        ``visit``: for estimation passes, a callable ``visit(k, index)`` that gets the keys
        ``[block_len, Hkv, D]`` of *every* CPU block, loaded without their values, instead of
        folding; ``state`` comes back unchanged."""
        chosen = list(range(len(ctx.cpu_blocks)))
        if visit is None:
            selected = self.select_blocks(chosen, engine, ctx, q)
            self.stats.add_comm(ctx.layer_id, ctx.is_prefill, len(selected), len(chosen))
            chosen = self._prefetched_first(selected, engine, ctx)
        load = functools.partial(engine.load_to_slot_layer, values=visit is None)
        slots = engine.num_slots
        for i in range(min(slots, len(chosen))):
            load(i, ctx.layer_id, ctx.cpu_blocks[chosen[i]], reuse_prefetch=True)
        engine.drop_prefetches()
        for i, index in enumerate(chosen):
            slot = i % slots
            engine.wait_slot_layer(slot)
            k, v = engine.get_kv_for_slot(slot, ctx.block_lens[index])
            if visit is None:
                state = self._fold_block(q, k, v, state, ctx, index)
            else:
                visit(k, index)
            engine.record_slot_compute_done(slot)
            if i + slots < len(chosen):
                load(slot, ctx.layer_id, ctx.cpu_blocks[chosen[i + slots]])
        return state

    def _fold_block(self, q, k, v, state, ctx: PolicyContext, index: int):
        """Prefill: ``attend_block`` then an LSE merge into ``state`` (``[1, Sq, Hq, D]``,
        ``[1, Hq, Sq]``). Decode: the fused in-place kernel on ``state`` (float32 ``[Hq, D]``,
        ``[Hq]``)."""
        if ctx.is_prefill:
            o_blk, lse_blk = self.attend_block(q, k, v, ctx, index)
            return merge_attention_outputs(*state, o_blk, lse_blk)
        decode_attend_merge(q[0, 0], k, v, *state, self.scale)
        return state

    def attend_block(self, q, k, v, ctx: PolicyContext, index: int):
        """Non-causal attention of q ``[1, Sq, Hq, D]`` over one loaded block ``[Sk, Hkv, D]``."""
        return flash_attn_with_lse(q, k.unsqueeze(0), v.unsqueeze(0), self.scale, causal=False)

    def attend_chunk(self, q, k, v, offload_engine, ctx: PolicyContext):
        """Causal attention of a prefill chunk q ``[1, Sq, Hq, D]`` over its own keys and values
        ``[Sq, Hkv, D]`` (the layer's prefill buffer), before the earlier blocks are streamed;
        ``(out [1, Sq, Hq, D], lse [1, Hq, Sq])``. A block-sparse policy estimates its mask here."""
        return flash_attn_with_lse(q, k.unsqueeze(0), v.unsqueeze(0), self.scale, causal=True)

    # ---- GPU-only mode -----------------------------------------------------------------
    def paged_prefill_attention(self, q, k, v, context, k_cache, v_cache, layer_id: int) -> torch.Tensor:
        """Prefill attention without offload (paged KV cache) of a packed batch, as
        :func:`nanovllm.ops.prefill_attention` with ``context``'s ``seqlens_q``, ``seqlens_k``
        and ``block_tables``. Default: dense."""
        return prefill_attention(q, k, v, context.seqlens_q, context.seqlens_k, self.scale, k_cache, v_cache,
                                 context.block_tables)

    # ---- statistics --------------------------------------------------------------------
    def sparse_stats(self) -> dict:
        """Compute and communication densities counted so far (see ``stats.py``)."""
        return self.stats.to_dict(self.dense_prefill)
