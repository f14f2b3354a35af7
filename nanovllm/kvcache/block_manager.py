"""KV block allocation over two tiers, with prefix caching across both.

A sequence's KV is a list of logical blocks of ``block_size`` tokens. Each lives in exactly one
tier: the GPU tier (``seq.block_table[i]``, a block of the paged device cache) or the host tier
(``seq.host_block_table[i]``, a block of the pinned host cache); the other table holds -1 there.
With no host blocks this is nano-vLLM's paged block manager.

- **Admission** (:meth:`BlockManager.can_allocate`, :meth:`BlockManager.allocate`): cached prefix
  blocks are shared, in whichever tier they are; the rest of the prompt is *reserved* (counted
  against the free blocks of both tiers) and placed when it is written. A host-tier hit that no
  live sequence holds is loaded back to the GPU tier when the GPU tier has room beyond every
  reservation, and always when it is the sequence's first block (``eviction.py``).
- **Writing** (:meth:`BlockManager.ensure_writable`): the blocks new tokens go to are GPU-tier
  blocks. When the GPU tier has none free, the placement rule (``placement.py``) names the coldest
  full block of a live sequence, which moves to a host block (a spill). Only when neither tier can
  give a block does :meth:`ensure_writable` fail (the scheduler then preempts). A live sequence
  holds its first block and the block it writes on the GPU (its first block stays on the host only
  when, at its admission, neither tier could give a GPU block), so with a host tier at most
  ``gpu_blocks // 2`` sequences are live at once.
- **Prefix caching**: a full block whose KV is computed is registered under
  ``hash = xxh64(parent_hash, token_ids)`` in an index shared by the tiers (``block_pool.py``).
  Registrations move with spilled blocks and survive while blocks are free: free blocks without a
  registration are reused first, registered ones least recently freed first; a registered GPU
  block about to be reused is written back to the host tier and stays registered there (the
  second level), until the host tier reuses that block in turn.
- **Sliding windows** (``release_window``: every layer of the model has a window, the widest W):
  after each :meth:`BlockManager.commit`, the blocks of a sequence wholly before the window of its
  next query (position ``c = num_computed_tokens``: blocks whose last token is before
  ``c - W + 1``) are released, in either tier: no later query of the sequence sees them. Their
  registration stays, so later prompts reuse them until their memory is reused, and the
  sequence's tables hold ``RELEASED`` there (read from the window's first block on only).

Every move between the tiers is queued (:meth:`BlockManager.take_moves`) and copied by the model
runner before the step's forward, in order.
"""
import itertools
import sys
from collections.abc import Callable

from nanovllm.sequence import Sequence
from nanovllm.kvcache.block_pool import NO_BLOCK, Block, BlockPool, compute_block_hash
from nanovllm.kvcache.eviction import BlockMove, TierMoves
from nanovllm.kvcache.placement import ColdestFirst

__all__ = ["NO_BLOCK", "RELEASED", "Block", "BlockManager", "BlockMove", "BlockPool", "compute_block_hash"]

RELEASED = -2
"""A logical block a running sequence released (wholly before every layer's sliding window): it is
in neither tier's table of the sequence any more."""


class BlockManager:
    """Args: num_gpu_blocks; block_size (tokens per block); num_host_blocks (0: no host tier);
    placement (the spill rule, default :class:`ColdestFirst`); release_window (tokens: every layer
    of the model attends through a sliding window at most this wide, so blocks before a running
    sequence's window are released; None: blocks are held until the sequence ends);
    write_ahead_blocks (with a host tier: how many of the registered free GPU blocks the GPU tier
    reuses next are written back ahead of their reuse, ``eviction.TierMoves.write_ahead``; 0: none);
    host_blocks_ready (called when those are decided: the host blocks below it can be written
    without waiting, the host tier's pinned ones; write-backs ahead take only those; None: all)."""

    def __init__(self, num_gpu_blocks: int, block_size: int, num_host_blocks: int = 0, placement=None,
                 release_window: int | None = None, write_ahead_blocks: int = 0,
                 host_blocks_ready: Callable[[], int] | None = None):
        self.block_size, self.release_window = block_size, release_window
        self.write_ahead_blocks, self.host_blocks_ready = write_ahead_blocks, host_blocks_ready
        self.index: dict[int, Block] = {}
        self.gpu = BlockPool("gpu", num_gpu_blocks, self.index)
        self.host = BlockPool("host", num_host_blocks, self.index)
        self.placement = placement or ColdestFirst()
        self.max_live_seqs = num_gpu_blocks // 2 if num_host_blocks else sys.maxsize
        self._live: dict[int, Sequence] = {}
        self._reserved: dict[int, int] = {}  # seq_id -> blocks promised at admission, not yet placed
        self._committed: dict[int, tuple[int, int, int]] = {}  # seq_id -> (blocks, last hash, last content id)
        self._released: dict[int, int] = {}  # seq_id -> its leading blocks released (outside the window)
        self.num_released_blocks = 0
        self.tiers = TierMoves(self.gpu, self.host, self.index, self.placement, self._live)
        self._content_ids = itertools.count()
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks of both tiers that are free and not reserved by an admitted sequence."""
        return self.gpu.num_free + self.host.num_free - sum(self._reserved.values())

    def is_live(self, seq: Sequence) -> bool:
        return seq.seq_id in self._live

    def _pool(self, tier: str) -> BlockPool:
        return self.gpu if tier == "gpu" else self.host

    def _block(self, seq: Sequence, i: int) -> Block:
        gpu_id = seq.block_table[i]
        return self.gpu.blocks[gpu_id] if gpu_id != NO_BLOCK else self.host.blocks[seq.host_block_table[i]]

    @staticmethod
    def _append(seq: Sequence, block: Block):
        on_gpu = block.tier == "gpu"
        seq.block_table.append(block.block_id if on_gpu else NO_BLOCK)
        seq.host_block_table.append(NO_BLOCK if on_gpu else block.block_id)

    # ---- admission ---------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        if seq.needs_prompt_logprobs:  # cached positions have no logits: compute the whole prompt
            return []
        hits, h, parent = [], -1, -1
        for i in range(len(seq) // self.block_size):
            token_ids = seq.block(i)
            h = compute_block_hash(token_ids, h)
            block = self.index.get(h)
            if block is None or block.token_ids != token_ids or block.parent != parent:
                break
            hits.append(block)
            parent = block.content_id
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be admitted: a live-sequence slot, and room in both tiers for the
        blocks of its current length that the prefix cache does not hold."""
        if len(self._live) >= self.max_live_seqs:
            return False
        hits = self._prefix_hits(seq)
        reused_free = sum(1 for b in hits if b.ref_count == 0)
        return seq.num_blocks - len(hits) + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence):
        """Admit ``seq``: share its cached prefix blocks and reserve the rest.

        Every hit is taken first (so that no move below reuses one); then host-tier hits that no
        live sequence holds are loaded back to the GPU tier, in order, while the GPU tier has more
        free blocks than all admitted sequences reserve (the first block in any case, spilling
        the coldest candidate if needed; it stays on the host only when no GPU block can be had).
        Sets ``seq.num_cached_tokens`` / ``num_computed_tokens`` to the tokens found in the cache;
        when the whole sequence is cached, its last token is still recomputed (to get logits).
        """
        assert seq.seq_id not in self._live and not seq.block_table
        hits = self._prefix_hits(seq)
        for block in hits:
            self._pool(block.tier).acquire(block)
            self._append(seq, block)
        last = hits[-1] if hits else None
        self._committed[seq.seq_id] = (len(hits), last.hash if last else -1, last.content_id if last else -1)
        self._reserved[seq.seq_id] = seq.num_blocks - len(hits)
        self._live[seq.seq_id] = seq
        for i, block in enumerate(hits):
            if block.tier == "host" and block.ref_count == 1 and (
                    i == 0 or self.gpu.num_free > sum(self._reserved.values())):
                loaded = self.tiers.load_back(block)
                if loaded is not None:
                    self.host.release(block)  # free again, as the GPU block's host copy
                    seq.block_table[i], seq.host_block_table[i] = loaded.block_id, NO_BLOCK
                    block = loaded
            if block.tier == "gpu" and i > 0:
                self.placement.add(block.block_id, i)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = min(seq.num_cached_tokens, len(seq) - 1)
        self.num_hit_tokens += seq.num_cached_tokens

    # ---- writing -----------------------------------------------------------------------
    def ensure_writable(self, seq: Sequence, num_tokens: int) -> int:
        """Give the next ``num_tokens`` tokens of ``seq`` (from ``num_computed_tokens``) GPU-tier
        blocks, spilling cold blocks to the host tier as needed; returns how many of them got
        one (fewer when the tiers run out; 0 for a decode step means: preempt)."""
        start = seq.num_computed_tokens
        needed = -(-(start + num_tokens) // self.block_size)
        while len(seq.block_table) < needed and self._place_new_block(seq):
            pass
        return max(0, min(num_tokens, len(seq.block_table) * self.block_size - start))

    def _place_new_block(self, seq: Sequence) -> bool:
        reserved = self._reserved.get(seq.seq_id, 0)
        if not reserved and self.num_free_blocks < 1:
            return False
        if self.gpu.num_free == 0 and not self.tiers.spill_coldest():
            return False
        self._append(seq, self.tiers.take_gpu())
        if reserved:
            self._reserved[seq.seq_id] = reserved - 1
        return True

    def can_place_blank(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` new blocks can be placed now with no move between the tiers, no
        preemption and no cached prefix dropped (async scheduling places the next step's blocks
        before it knows which sequences finished, and then must change nothing the synchronous
        loop would not)."""
        return num_blocks <= self.num_free_blocks and self.gpu.takes_are_blank(num_blocks)

    def can_place(self, num_blocks: int, new_candidates: int = 0) -> bool:
        """Whether ``num_blocks`` new blocks for sequences without reservations can be placed now
        without a preemption: the GPU tier's free blocks first (writing back what they hold),
        then a spill per block, from the spill candidates and ``new_candidates`` more."""
        spills = max(0, num_blocks - self.gpu.num_free)
        return num_blocks <= self.num_free_blocks and self.tiers.can_spill(spills, new_candidates)

    def filled_ahead(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """``(logical index, GPU block)`` of the blocks of ``seq`` other than its first that are
        full once its first ``num_tokens`` tokens are computed and that :meth:`commit` has not
        reached (async scheduling: blocks the step still running fills)."""
        done = self._committed[seq.seq_id][0]
        return [(i, seq.block_table[i]) for i in range(max(done, 1), num_tokens // self.block_size)
                if seq.block_table[i] != NO_BLOCK]

    def add_candidates(self, blocks: list[tuple[int, int]]):
        """Blocks from :meth:`filled_ahead` become spill candidates before their commit (which
        then touches them again, in the same order: the synchronous loop's candidates)."""
        for index, gpu_id in blocks:
            self.placement.add(gpu_id, index)

    def take_moves(self) -> list[BlockMove]:
        """The moves between the tiers decided since the last call, in order (``eviction.py``),
        then the write-backs ahead of reuse of the next ``write_ahead_blocks`` registered free GPU
        blocks (into host blocks below ``host_blocks_ready()``); the model runner copies them before
        the next forward (the ahead ones during it)."""
        ready = self.host.num_blocks if self.host_blocks_ready is None else self.host_blocks_ready()
        self.tiers.write_ahead(self.write_ahead_blocks, ready)
        return self.tiers.take()

    # ---- release and registration ------------------------------------------------------
    def deallocate(self, seq: Sequence):
        """Drop ``seq``'s references and reservation; blocks at zero references become free
        (keeping their registration)."""
        for i in reversed(range(self._released.get(seq.seq_id, 0), len(seq.block_table))):
            self._drop(seq, i)
        seq.block_table, seq.host_block_table = [], []
        for table in (self._live, self._reserved, self._committed, self._released):
            table.pop(seq.seq_id, None)

    def _drop(self, seq: Sequence, i: int):
        """``seq``'s reference to its logical block ``i`` (a free block keeps its registration)."""
        block = self._block(seq, i)
        if self._pool(block.tier).release(block) and block.tier == "gpu":
            self.placement.remove(block.block_id)

    def commit(self, seq: Sequence):
        """Register every full block whose KV is now computed (so later prompts can reuse it);
        full GPU blocks other than the first become spill candidates."""
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        done, parent_hash, parent_id = self._committed[seq.seq_id]
        for i in range(done, num_full):
            block = self._block(seq, i)
            if block.hash == -1:
                block.token_ids = seq.block(i)
                block.hash = compute_block_hash(block.token_ids, parent_hash)
                block.content_id, block.parent = next(self._content_ids), parent_id
                self.index.setdefault(block.hash, block)
            if block.tier == "gpu" and i > 0:
                self.placement.add(block.block_id, i)
            parent_hash, parent_id = block.hash, block.content_id
        self._committed[seq.seq_id] = (max(done, num_full), parent_hash, parent_id)
        if self.release_window is not None:
            self._release_outside_window(seq)

    def _release_outside_window(self, seq: Sequence):
        """Release ``seq``'s blocks wholly before the window of its next query (module doc); they
        are full and committed, so they stay registered."""
        first = max(0, seq.num_computed_tokens - self.release_window + 1) // self.block_size
        done = self._released.get(seq.seq_id, 0)
        for i in range(done, first):
            self._drop(seq, i)
            seq.block_table[i] = seq.host_block_table[i] = RELEASED
        if first > done:
            self._released[seq.seq_id] = first
            self.num_released_blocks += first - done

    def reset_prefix_cache(self) -> bool:
        """Drop the registration of every free block of both tiers (cached prefixes no live
        sequence holds), so no later prompt hits them. Returns True when the prefix cache is then
        empty, False when live sequences still hold registered blocks (kept: they are in use)."""
        for pool in (self.gpu, self.host):
            dropped = [i for i in pool.free if pool.blocks[i].hash != -1]
            for i in dropped:
                pool.forget(pool.blocks[i])
                pool.free.move_to_end(i, last=False)
        return not self.index

    def usage(self) -> dict:
        """Block counts of both tiers (used = held by live sequences), the cumulative spills,
        write-backs of evicted prefix-cache blocks, prefix-cache hits and blocks released outside
        sliding windows, as plain ints."""
        return {"gpu_blocks": self.gpu.num_blocks, "gpu_blocks_used": self.gpu.num_blocks - self.gpu.num_free,
                "host_blocks": self.host.num_blocks, "host_blocks_used": self.host.num_blocks - self.host.num_free,
                "spilled_blocks": self.tiers.num_spilled, "evicted_blocks": self.tiers.num_written_back,
                "prefix_cache_hit_tokens": self.num_hit_tokens, "released_blocks": self.num_released_blocks}
