"""KV bookkeeping of offload mode: sequences' logical blocks mapped to host (CPU) blocks.

Rule (no tiering): in offload mode every sequence's KV lives on the host. Prefill runs in chunks
of one block; chunk i is offloaded to the sequence's i-th CPU block. The prefill length is
recorded when the sequence is admitted (``seq.num_prefill_tokens``), so the last prefill block's
valid length never depends on the growing ``len(seq)``. Decode tokens collect in the sequence's
GPU decode-buffer row; when the row holds a full block it is offloaded to a new CPU block.
No prefix caching: a finished sequence's blocks and row return to the free lists at once, so
nothing leaks from one request to the next.
"""
from collections import deque

from nanovllm.engine.sequence import Sequence


class HybridKVManager:
    """Block manager of offload mode (same interface as :class:`BlockManager`).

    Args:
        num_cpu_blocks: host blocks. block_size: tokens per block. num_decode_rows: decode buffers.
    """

    def __init__(self, num_cpu_blocks: int, block_size: int, num_decode_rows: int):
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.free_block_ids: deque[int] = deque(range(num_cpu_blocks))
        self.free_rows: deque[int] = deque(range(num_decode_rows))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_allocate(self, seq: Sequence) -> bool:
        return bool(self.free_rows) and seq.num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence):
        """CPU blocks for the whole prefill, a decode row, and the recorded prefill length."""
        assert not seq.block_table
        seq.block_table = [self.free_block_ids.popleft() for _ in range(seq.num_blocks)]
        seq.decode_row = self.free_rows.popleft()
        seq.num_prefill_tokens = len(seq)
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def deallocate(self, seq: Sequence):
        self.free_block_ids.extend(seq.block_table)
        seq.block_table = []
        if seq.decode_row >= 0:
            self.free_rows.append(seq.decode_row)
            seq.decode_row = -1

    def commit(self, seq: Sequence):
        """Nothing to register: offload mode has no prefix cache."""

    @staticmethod
    def decode_offset(seq: Sequence, position: int) -> int:
        """Index of ``position`` in the sequence's decode buffer."""
        return (position - seq.num_prefill_tokens) % seq.block_size

    @staticmethod
    def num_offloaded_blocks(seq: Sequence, position: int) -> int:
        """CPU blocks holding KV before ``position`` (decode): prefill blocks + full decode blocks."""
        prefill_blocks = -(-seq.num_prefill_tokens // seq.block_size)
        return prefill_blocks + (position - seq.num_prefill_tokens) // seq.block_size

    @staticmethod
    def block_lens(seq: Sequence, num_blocks: int) -> list[int]:
        """Valid tokens of the first ``num_blocks`` CPU blocks (only the last prefill block may be
        partial; its length comes from the recorded prefill length)."""
        prefill_blocks = -(-seq.num_prefill_tokens // seq.block_size)
        last = seq.num_prefill_tokens - (prefill_blocks - 1) * seq.block_size
        return [last if i == prefill_blocks - 1 else seq.block_size for i in range(num_blocks)]

    def _fills_buffer(self, seq: Sequence) -> bool:
        return self.decode_offset(seq, len(seq) - 1) == self.block_size - 1

    def can_append(self, seq: Sequence) -> bool:
        return not self._fills_buffer(seq) or self.num_free_blocks >= 1

    def may_append(self, seq: Sequence):
        """When this step's token completes the decode buffer, give it the CPU block to go to."""
        if self._fills_buffer(seq):
            seq.block_table.append(self.free_block_ids.popleft())
