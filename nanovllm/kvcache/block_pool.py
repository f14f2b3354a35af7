"""Physical KV blocks of one tier, with the identity of the content each holds.

A block's content is identified for the prefix cache by ``hash = xxh64(parent_hash, token_ids)``
plus a content id chained to its parent's (a hit checks token ids and the chain, so a hash
collision is a miss). A block is *registered* when the shared index maps its hash to it. A GPU
block may have a *host copy*: a host block holding the same content (left behind when a host
block was loaded back to the GPU tier), so that moving it to the host again needs no copy; the two
point at each other through ``copy`` and the index maps the hash to the GPU block.
"""
import itertools
from collections import OrderedDict

import numpy as np
import xxhash

NO_BLOCK = -1


def compute_block_hash(token_ids: list[int], parent_hash: int = -1) -> int:
    """xxh64 of the parent block's hash (if any) followed by the block's token ids (int32)."""
    h = xxhash.xxh64()
    if parent_hash != -1:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.intdigest()


class Block:
    """One physical block of a tier (``tier``: "gpu" or "host"), its references and content."""

    __slots__ = ("block_id", "tier", "ref_count", "hash", "token_ids", "content_id", "parent", "copy")

    def __init__(self, block_id: int, tier: str):
        self.block_id, self.tier, self.ref_count, self.copy = block_id, tier, 0, None
        self.clear()

    def clear(self):
        """Forget the content (hash -1: not registered) and the link to a copy of it."""
        self.unlink()
        self.hash, self.token_ids, self.content_id, self.parent = -1, [], -1, -1

    def unlink(self):
        """This block and its copy (if any) stop being copies of each other."""
        if self.copy is not None:
            self.copy.copy = None
            self.copy = None

    def link(self, other: "Block"):
        """``other`` holds the same content in the other tier."""
        self.unlink()
        other.unlink()
        self.copy, other.copy = other, self

    def take_content(self, other: "Block"):
        """Hold ``other``'s content (hash, token ids, content id, parent), not its copy link."""
        self.hash, self.token_ids = other.hash, other.token_ids
        self.content_id, self.parent = other.content_id, other.parent

    def is_registered(self, index: dict[int, "Block"]) -> bool:
        """Whether the index maps this block's hash to this very block."""
        return self.hash != -1 and index.get(self.hash) is self


class BlockPool:
    """One tier's blocks: reference counts and the free list (unregistered blocks first, then
    registered ones least recently freed first). ``index`` is the hash index shared by the tiers."""

    def __init__(self, tier: str, num_blocks: int, index: dict[int, Block]):
        self.tier = tier
        self.blocks = [Block(i, tier) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.index = index

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def peek(self) -> Block:
        """The block the next :meth:`take` returns (the pool has a free block)."""
        return self.blocks[next(iter(self.free))]

    def take(self) -> Block:
        """A free block for new content (dropping the registration of what it held)."""
        block = self.blocks[self.free.popitem(last=False)[0]]
        self.forget(block)
        block.ref_count = 1
        return block

    def takes_are_blank(self, num_blocks: int) -> bool:
        """Whether the next ``num_blocks`` :meth:`take` calls find free blocks holding no
        registered content (so they drop no cached prefix and move nothing to the host)."""
        return num_blocks <= self.num_free and all(
            self.blocks[i].hash == -1 for i in itertools.islice(self.free, num_blocks))

    def forget(self, block: Block):
        if block.is_registered(self.index):
            del self.index[block.hash]
        block.clear()

    def acquire(self, block: Block):
        """One more reference to ``block`` (a prefix-cache hit)."""
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> bool:
        """One reference less; True when the block became free (a registered one as the most
        recently freed)."""
        block.ref_count -= 1
        if block.ref_count:
            return False
        self.free[block.block_id] = None
        if block.hash == -1:
            self.free.move_to_end(block.block_id, last=False)
        return True

    def touch(self, block: Block):
        """A free ``block`` becomes the most recently freed."""
        self.free.move_to_end(block.block_id)
