"""How blocks move between the tiers, and the copies a step carries (used by ``BlockManager``).

Three moves, decided on the scheduler's side and copied by the model runner before the step's
forward (``KVCache.begin_step``), in the order they were decided:

- **spill** (a live block, GPU -> host): a block must be written and the GPU tier has none free;
  the spill rule's coldest candidate (``placement.py``) moves to a host block and every sequence
  sharing it follows. A block with a host copy moves without copying.
- **write-back** (an evicted prefix-cache block, GPU -> host): a free GPU block about to be reused
  still holds registered content; the content is written to a host block and stays registered
  there (a block with a host copy hands it the registration instead, with no copy). The host block
  is free (no live sequence holds it), the most recently freed of its tier. The host tier gives a
  block as always: an unregistered free one first, else the coldest registered free one (whose
  content is dropped), never a live sequence's block. Without a free host block the content is
  dropped, as with no host tier.
- **write-back ahead** (a registered free GPU block the GPU tier reuses soon, GPU -> host): decided
  with each step's moves (:meth:`TierMoves.write_ahead`) for the blocks among the next the GPU tier
  reuses, into blank host blocks already pinned (``host_memory.py``: no step waits for them); the
  block stays registered in the GPU tier with a host copy, so its write-back at reuse moves nothing.
  Its copy overlaps the step (an ``ahead`` move: that step's forward does not wait for it, the next
  step's does).
- **load-back** (a host-tier prefix hit, host -> GPU): at admission, a hit that no live sequence
  holds is copied to a GPU block (``BlockManager.allocate`` says when) and the hash registered
  there; the host block stays, free, as its *host copy* (``block_pool.py``), so the block spills
  or is written back again without a copy while nothing reuses that host block.

Ordering: the copies of a step run in decision order on one stream (``HostTier.move``), so a move
may read what an earlier move of the step wrote (content written back, then loaded again; a GPU
block freed by a spill, then loaded into). The copies start after the device finished every step
launched before (with async scheduling: the step still running), and that step's forward waits
for them, so a copy never reads a block a running step is writing, nor writes one it reads.

Counts: ``free GPU + free host`` blocks change as without these moves: a write-back takes a free
host block and leaves it free; a load-back takes a free GPU block and frees its host block (one
free block used, as a hit on the host block would be); a spill uses a free host block for a GPU
block that is used again at once. Admission (``BlockManager.can_allocate``) counts both tiers.
"""
import itertools
from typing import NamedTuple

from nanovllm.kvcache.block_pool import NO_BLOCK, Block, BlockPool
from nanovllm.kvcache.placement import ColdestFirst
from nanovllm.sequence import Sequence


class BlockMove(NamedTuple):
    """One block of every layer copied between the tiers: GPU block ``gpu`` to host block ``host``
    when ``to_host`` (a spill or a write-back), else host block ``host`` to GPU block ``gpu`` (a
    load-back). ``ahead``: a write-back ahead of reuse, which the step's forward does not wait for
    (the next step's does)."""

    gpu: int
    host: int
    to_host: bool
    ahead: bool = False


class TierMoves:
    """The moves of blocks between the tiers (module doc) and the copies queued for the next step.

    Args: the GPU and host pools and the index they share; the spill rule; the live sequences
    (seq_id -> Sequence; their block tables follow spilled blocks). A host pool of 0 blocks: no
    host tier (nothing moves).
    """

    def __init__(self, gpu: BlockPool, host: BlockPool, index: dict[int, Block], placement: ColdestFirst,
                 live: dict[int, Sequence]):
        self.gpu, self.host, self.index, self.placement, self.live = gpu, host, index, placement, live
        self.moves: list[BlockMove] = []
        self.num_spilled = self.num_written_back = 0

    def take(self) -> list[BlockMove]:
        """The moves decided since the last call, in order (the next step copies them)."""
        moves, self.moves = self.moves, []
        return moves

    def take_gpu(self) -> Block:
        """A free GPU block for new content (the GPU tier has one); registered content it holds
        is written back to the host tier first."""
        block = self.gpu.peek()
        if self.host.num_blocks and block.is_registered(self.index):
            self._write_back(block)
        return self.gpu.take()

    def _write_back(self, src: Block):
        dst = src.copy
        if dst is None:
            if not self.host.num_free:
                return  # no room: the content is dropped
            dst = self.host.take()
            dst.take_content(src)
            self.host.release(dst)  # free, registered, the most recently freed
            self.moves.append(BlockMove(src.block_id, dst.block_id, True))
            self.num_written_back += 1
        else:
            self.host.touch(dst)
        self.index[src.hash] = dst
        src.unlink()

    def write_ahead(self, window: int, host_ready: int):
        """Write back ahead of their reuse the registered free GPU blocks among the next ``window``
        free blocks the GPU tier reuses (blank ones first: with ``window`` blank free blocks
        nothing is written) that have no host copy, while the host tier's next block is blank (no
        cached prefix is dropped for it) and below ``host_ready`` (written without waiting: the host
        memory is pinned): each gets a host copy, so that reusing it later hands the registration
        over without a copy. The copies are ``ahead`` moves: they overlap the step they are issued
        with."""
        if not self.host.num_blocks:
            return
        for block_id in itertools.islice(self.gpu.free, window):
            block = self.gpu.blocks[block_id]
            if block.copy is not None or not block.is_registered(self.index):
                continue
            if not self.host.takes_are_blank(1) or self.host.peek().block_id >= host_ready:
                break
            dst = self.host.take()
            dst.take_content(block)
            self.host.release(dst)  # free: a copy of a block registered in the GPU tier
            block.link(dst)
            self.moves.append(BlockMove(block_id, dst.block_id, True, ahead=True))
            self.num_written_back += 1

    def can_spill(self, num_blocks: int, new_candidates: int = 0) -> bool:
        """Whether ``num_blocks`` spills in a row can be made now, with ``new_candidates`` more
        spill candidates than the rule holds (each spill needs a candidate and a free host block)."""
        return num_blocks <= min(len(self.placement) + new_candidates, self.host.num_free)

    def spill_coldest(self) -> bool:
        """Move the coldest spill candidate to the host tier (False: no candidate, or no free
        host block); the GPU block it held is free afterwards."""
        victim = self.placement.victim() if self.host.num_free else None
        if victim is None:
            return False
        gpu_id, index = victim
        src = self.gpu.blocks[gpu_id]
        dst = src.copy
        if dst is not None:  # a host copy is free: it becomes the block again
            self.host.acquire(dst)
            src.unlink()
        else:
            dst = self.host.take()
            dst.take_content(src)
            self.moves.append(BlockMove(gpu_id, dst.block_id, True))
        dst.ref_count = src.ref_count
        if src.is_registered(self.index):
            self.index[src.hash] = dst
        for seq in self.live.values():  # every sequence sharing the block reads it from the host now
            if index < len(seq.block_table) and seq.block_table[index] == gpu_id:
                seq.block_table[index], seq.host_block_table[index] = NO_BLOCK, dst.block_id
        src.clear()
        src.ref_count = 1
        self.gpu.release(src)
        self.placement.remove(gpu_id)
        self.num_spilled += 1
        return True

    def load_back(self, src: Block) -> Block | None:
        """Copy host block ``src`` (held by the caller, so that nothing takes it meanwhile) to a
        GPU block, spilling the coldest candidate when the GPU tier has no free block; returns
        the GPU block (one reference), which takes ``src``'s registration and keeps ``src`` as
        its host copy, or None when no GPU block can be had."""
        if not self.gpu.num_free and not self.spill_coldest():
            return None
        dst = self.take_gpu()
        dst.take_content(src)
        if src.is_registered(self.index):
            self.index[src.hash] = dst
        dst.link(src)
        self.moves.append(BlockMove(dst.block_id, src.block_id, False))
        return dst
