"""Paged KV block allocation with prefix caching (GPU-only mode).

Blocks hold ``block_size`` tokens. A full block whose KV has been computed is registered under
``hash = xxh64(parent_hash, token_ids)``; a later prompt with the same prefix reuses it after
its token ids are compared (a hash collision never reuses a wrong block). Freed blocks keep
their hash and are reused last (least recently freed first), so the cache survives as long as
memory allows.
"""
from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


def compute_block_hash(token_ids: list[int], parent_hash: int = -1) -> int:
    """xxh64 of the parent block's hash (if any) followed by the block's token ids (int32)."""
    h = xxhash.xxh64()
    if parent_hash != -1:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "version", "parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.version = 0  # bumped each time the block is reused for other content
        self.parent: tuple[int, int] | None = None  # (block_id, version) of the previous block


class BlockManager:
    """Allocates blocks to sequences, shares cached prefix blocks, counts references.

    Args:
        num_blocks: blocks in the KV cache pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks in reuse order: uncached first, then cached ones least recently freed first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        block.version += 1
        block.parent = None
        return block

    def _cached_block(self, token_ids: list[int], h: int, parent) -> Block | None:
        block_id = self.hash_to_block_id.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent != parent:
            return None
        return block

    def _num_prefix_hits(self, seq: Sequence) -> list[Block]:
        if seq.needs_prompt_logprobs:  # cached positions have no logits: compute the whole prompt
            return []
        hits, h, parent = [], -1, None
        for i in range(len(seq) // self.block_size):
            token_ids = seq.block(i)
            h = compute_block_hash(token_ids, h)
            block = self._cached_block(token_ids, h, parent)
            if block is None:
                break
            hits.append(block)
            parent = (block.block_id, block.version)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._num_prefix_hits(seq)
        reusable_free = sum(1 for b in hits if b.ref_count == 0)
        return seq.num_blocks - len(hits) + reusable_free <= self.num_free_blocks

    def allocate(self, seq: Sequence):
        """Give ``seq`` a block table for its whole current length, reusing cached prefix blocks.

        Sets ``seq.num_cached_tokens`` / ``num_computed_tokens`` to the tokens found in the cache;
        when the whole sequence is cached, its last token is still recomputed (to get logits).
        """
        assert not seq.block_table
        hits = self._num_prefix_hits(seq)
        for block in hits:
            if block.ref_count == 0:
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = min(seq.num_cached_tokens, len(seq) - 1)

    def deallocate(self, seq: Sequence):
        """Drop ``seq``'s references; blocks at zero references become free (keeping their hash)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash == -1:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []

    def commit(self, seq: Sequence):
        """Register every full block whose KV is now computed, so later prompts can reuse it."""
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        parent, parent_key = -1, None
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                block.token_ids = seq.block(i)
                block.hash = compute_block_hash(block.token_ids, parent)
                block.parent = parent_key
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            parent, parent_key = block.hash, (block.block_id, block.version)

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``seq`` can grow by one token (a new block is needed every block_size tokens)."""
        return len(seq.block_table) >= seq.num_blocks or self.num_free_blocks >= 1

    def may_append(self, seq: Sequence):
        """Add a block to ``seq``'s table when its newest token starts a new block."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)
