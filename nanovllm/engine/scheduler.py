"""Chooses which sequences run in the next step: a prefill batch or a decode batch."""
import logging
from collections import deque

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stopping import check_stop
from nanovllm.kvcache.block_manager import BlockManager

logger = logging.getLogger(__name__)


class Scheduler:
    """nano-vLLM's scheduler with chunked prefill over a two-tier KV cache.

    Prefill has priority: waiting sequences are admitted while the block manager has room in both
    tiers and the token budget (``max_num_batched_tokens``) lasts; a prompt longer than the
    remaining budget, or than the GPU tier can take in one step, is prefilled in chunks over several
    steps (only the head of the waiting queue can be part-way). Otherwise all running sequences
    decode one token. The block manager spills cold blocks to the host tier to make GPU room; when
    both tiers are full, the most recently admitted running sequence is preempted and later
    recomputed. The spills decided for a step go to the model runner with it (:meth:`take_spills`).
    """

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = set(config.eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return the sequences of the next step and whether it is a prefill step."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def take_spills(self) -> list[tuple[int, int]]:
        """The ``(GPU block, host block)`` copies the last :meth:`schedule` decided."""
        return self.block_manager.take_spills()

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled, budget, manager = [], self.max_num_batched_tokens, self.block_manager
        while self.waiting and budget > 0 and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if not manager.is_live(seq):
                if not manager.can_allocate(seq):
                    break
                manager.allocate(seq)
            chunk = manager.ensure_writable(seq, min(len(seq) - seq.num_computed_tokens, budget))
            if not chunk:
                break
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            scheduled.append(seq)
            if seq.num_computed_tokens + chunk < len(seq):
                break
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.ensure_writable(seq, 1):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def abort(self, seq_ids: set[int]):
        """Drop these requests wherever they are, freeing their blocks."""
        for queue in (self.waiting, self.running):
            for seq in [s for s in queue if s.seq_id in seq_ids]:
                queue.remove(seq)
                if self.block_manager.is_live(seq):
                    self.block_manager.deallocate(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"

    def _preempt(self, seq: Sequence):
        logger.debug("preempting sequence %d (%d tokens)", seq.seq_id, len(seq))
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.reset_for_recompute()
        part_way = self.waiting and self.block_manager.is_live(self.waiting[0])
        self.waiting.insert(1 if part_way else 0, seq)  # behind a part-way prefill, which must finish first

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Advance KV progress, append sampled tokens, finish sequences; return the finished ones.

        ``token_ids[i]`` is None for a prefill chunk that did not reach the end of its sequence.
        """
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.commit(seq)
            if token_id is None:
                continue
            seq.append_token(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason:
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        reason, seq.stop_reason = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        return reason
