"""Chooses which sequences run in the next step: a prefill batch or a decode batch."""
import logging
import time
from collections import deque

from nanovllm.config import Config
from nanovllm.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from nanovllm.engine.sampling_batch import nothing_to_sample
from nanovllm.engine.stopping import check_stop, may_stop_on_token, reaches_length_limit
from nanovllm.kvcache.block_manager import BlockManager, BlockMove

logger = logging.getLogger(__name__)


def longest_first(batch: list[Sequence]) -> list[Sequence]:
    """A decode batch in the order its rows run: the longest contexts first (ties keep their
    order), so that the paged decode attention kernel, whose programs start in row order, starts
    the longest ones first and no long program starts last, while the others have finished
    (longest-processing-time-first scheduling). Every context grows by one token a step, so a
    sorted batch stays sorted and sorting it again is linear."""
    return sorted(batch, key=len, reverse=True)


class Scheduler:
    """nano-vLLM's scheduler with chunked prefill over a two-tier KV cache.

    Prefill has priority: waiting sequences are admitted while the block manager has room in both
    tiers and the token budget (``max_num_batched_tokens``) lasts; a prompt longer than the
    remaining budget, or than the GPU tier can take in one step, is prefilled in chunks over several
    steps (only the head of the waiting queue can be part-way). Otherwise all running sequences
    decode one token. The block manager spills cold blocks to the host tier to make GPU room; when
    both tiers are full, the most recently admitted running sequence is preempted and later
    recomputed. The moves between the tiers decided for a step go to the model runner with it
    (:meth:`take_moves`).

    With async scheduling, :meth:`schedule_decode_ahead` and :meth:`schedule_prefill_ahead`
    schedule the step after one still running on the device, before its tokens are known
    (``nanovllm.engine.step_loop``).
    """

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = set(config.eos_token_ids)
        self.vocab_size = config.hf_config.vocab_size
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

    def take_moves(self) -> list[BlockMove]:
        """The copies between the tiers the last scheduling decided (spills, write-backs of evicted
        prefix-cache blocks, load-backs of host hits: ``nanovllm.kvcache.eviction``)."""
        return self.block_manager.take_moves()

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
            seq.schedule(chunk)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            budget -= chunk
            scheduled.append(seq)
            if not seq.samples_token:  # part-way: the chunk does not complete its prompt
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
                seq.schedule(1)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return longest_first(scheduled)

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

    def schedule_decode_ahead(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """The decode step after ``seqs``, a decode step whose sampled tokens are still on the
        device, scheduled as the synchronous loop would after :meth:`postprocess`; or None when
        that cannot be done without those tokens.

        Possible only when nothing waits (so ``running`` is the unfinished ``seqs`` and no
        admission is due), no request of ``seqs`` has a bad word of several tokens, and the step's
        new blocks can be placed without a preemption, either (a) with no move between the tiers
        and no cached prefix dropped, while the sequences stopping in ``seqs`` still hold their
        blocks, or (b) with a host tier, with moves (spills, write-backs) when no sequence of
        ``seqs`` can finish with its token (by length or by its value): postprocessing then frees
        nothing, so the synchronous loop makes the same moves (the blocks ``seqs`` fill become
        spill candidates here, as their commit would make them). Then the tokens of ``seqs`` get
        placeholders (:meth:`_advance`) and the step is every unfinished sequence of ``seqs`` that
        does not reach its length limit with them; one that stops on its token (eos, stop id, stop
        string) is computed once more, and that result is dropped.
        """
        if self.waiting or any(seq.sampling_params.has_multi_token_bad_words for seq in seqs):
            return None  # a multi-token bad word's mask needs the step's tokens on the host
        live = [seq for seq in seqs if not seq.is_finished]  # those that stopped in the step before are done
        batch = [seq for seq in live if not reaches_length_limit(seq, self.max_model_len, 1)]
        # the step writes position num_computed_tokens + 1: a new block when no block holds it yet
        manager = self.block_manager
        new_blocks = sum(len(seq.block_table) * manager.block_size <= seq.num_computed_tokens + 1 for seq in batch)
        if not batch:
            return None
        filled = []
        if not manager.can_place_blank(new_blocks):
            # postprocessing would commit the blocks ``seqs`` fill (the warmest spill candidates)
            filled = [b for seq in live for b in manager.filled_ahead(seq, seq.num_computed_tokens + 1)]
            if len(batch) < len(live) or any(may_stop_on_token(seq, self.eos_token_ids) for seq in live) \
                    or not manager.can_place(new_blocks, len(filled)):
                return None
        for seq in live:
            self._advance(seq, sampled=True)
        manager.add_candidates(filled)
        for seq in batch:
            manager.ensure_writable(seq, 1)
            seq.schedule(1)
        return longest_first(batch)

    def schedule_prefill_ahead(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """The prefill step after ``seqs``, a prefill step whose sampled tokens are still on the
        device, scheduled as the synchronous loop would after :meth:`postprocess`; or None when
        that needs those tokens (nothing is changed then).

        Possible when requests wait (the synchronous loop prefills next) and no sequence that
        completes its prompt in ``seqs`` can stop on its first token, by length or by the token's
        value (:func:`may_stop_on_token`): its stop would free blocks and a sequence slot before
        the next step is scheduled. Postprocessing then changes nothing the scheduler reads but
        the progress of ``seqs``, which is made here: each is advanced (a placeholder for the
        token of those that complete their prompt) and its full blocks are committed to the
        prefix cache, so later prompts hit them as in the synchronous loop. The result may be
        empty (nothing can be admitted yet); ``seqs`` are advanced all the same.
        """
        if not self.waiting:
            return None
        completing = [seq.samples_token for seq in seqs]
        if any(done and (reaches_length_limit(seq, self.max_model_len, 1) or may_stop_on_token(seq, self.eos_token_ids))
               for seq, done in zip(seqs, completing)):
            return None
        for seq, done in zip(seqs, completing):
            self._advance(seq, sampled=done)
            self.block_manager.commit(seq)
        return self._schedule_prefill()

    @staticmethod
    def _advance(seq: Sequence, sampled: bool):
        """The step's KV is computed; its sampled token (if any) is a placeholder until known."""
        seq.computed()
        if sampled:
            seq.append_token(PLACEHOLDER_TOKEN)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None], advanced: bool = False) -> list[Sequence]:
        """Advance KV progress, append sampled tokens, finish sequences; return the finished ones.

        ``token_ids[i]`` is None for a prefill chunk that did not reach the end of its sequence.
        ``advanced``: the step after ``seqs`` was scheduled ahead, which advanced them already
        (their tokens are placeholders, filled in here). A sequence finished already (computed
        once more by an overlapped step after it stopped) is left as it is.
        """
        finished, with_long_bad_words, now = [], [], time.time()
        for seq, token_id in zip(seqs, token_ids):
            if seq.is_finished:
                continue
            if not advanced:
                self._advance(seq, sampled=token_id is not None)
            if token_id is not None:
                seq.fill_token(token_id)
                seq.last_token_time = now
                if seq.first_token_time is None:
                    seq.first_token_time = now
            self.block_manager.commit(seq)
            if token_id is None:
                continue
            reason = self._finish_reason(seq, token_id)
            if reason:
                seq.finish_reason = reason
                seq.finished_time = now
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
            elif seq.sampling_params.bad_words_token_ids and any(
                    len(ids) > 1 for ids in seq.sampling_params.bad_words_token_ids):
                with_long_bad_words.append(seq)
        for seq in with_long_bad_words:  # after every sequence is updated, so that the step stays whole if one raises
            self._check_samplable(seq)
        return finished

    def _check_samplable(self, seq: Sequence):
        """Raise when the bad words that the sequence's last tokens begin leave it no token to
        sample next (the first token's masks were checked when the request was queued; only a
        longer bad word's ban grows with the output).

        Raises:
            RuntimeError: naming the sequence, its generated tokens and the masks.
        """
        why = nothing_to_sample(seq.sampling_params, seq.token_ids, seq.num_prompt_tokens, self.eos_token_ids,
                                self.vocab_size)
        if why:
            raise RuntimeError(f"sequence {seq.seq_id}, after {seq.num_completion_tokens} generated tokens "
                               f"{seq.completion_token_ids[-8:]}: {why}")

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        reason, seq.stop_reason = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        return reason
