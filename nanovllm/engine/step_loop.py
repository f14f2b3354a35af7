"""The engine's step loop, with async scheduling: the host schedules and prepares step N+1 while
the device runs step N (vLLM's ``--async-scheduling``, SGLang's overlap scheduler).

Step N's sampled tokens stay on the device and are step N+1's input ids; the host reads them
(and the logprobs) one step later, after launching N+1, for the stop checks, detokenization,
logprobs and block bookkeeping. Until then each sequence holds a placeholder token
(``sequence.PLACEHOLDER_TOKEN``), so lengths, positions and slots of step N+1 are right.

When it overlaps: ``Config.async_scheduling`` is on (the CUDA default where supported: tensor
parallelism 1; see ``Config``); every step
is then launched without waiting for it, and the next step is launched before reading it when the
scheduler can schedule it without the step's tokens:

- after a decode step, :meth:`Scheduler.schedule_decode_ahead`: a decode step of the same
  sequences (those reaching ``max_tokens`` / ``max_model_len`` left out), when nothing waits to be
  admitted and its new blocks need no preemption and either move nothing between the KV tiers and
  drop no cached prefix, or (host tier) move blocks when no sequence can finish with its token;
- after a prefill step, :meth:`Scheduler.schedule_prefill_ahead`: the next prefill chunk, when
  requests wait and no sequence completing its prompt in the step can stop on its first token
  (by length, or by its value: eos, stop token ids, stop strings), so that reading the tokens
  would change nothing the scheduler looks at (e.g. ``ignore_eos`` or ``min_tokens`` > 1).

Otherwise (the first decode step after prefill, a prefill after decode, a preemption, a full
cache, a first token that may stop its sequence) the in-flight step is read first and the next one
scheduled as in the synchronous loop. With the host tier, a step scheduled ahead carries its moves (spills,
write-backs, load-backs) like any step: the model runner queues their copies when it launches the
step, and they start once the device finished the step before (``nanovllm.kvcache.host_tier``), so
a block that step still writes or reads is never copied over; a batch with no host-resident block
runs the GPU-only path (paged kernels, CUDA graphs). Either way the steps are the synchronous loop's, except
that a sequence stopping on a sampled token (eos, stop token id, stop string) is computed in one
more step, whose token, logprobs and KV are dropped (its blocks are freed when its stop is read).
Block counts and the prefix cache end as in the synchronous loop. Outputs (greedy, seeded) are
the synchronous loop's, to the bit where no sequence stops on a sampled token; where one does, its
extra row can change the padded shapes of that one step for the others (CUDA-graph batch size,
the CPU decode attention's longest context), so their logprobs may differ in float rounding.
"""
import torch

from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sampling_batch import SampledStep, StepOutput
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sequence import Sequence
from nanovllm.utils.tensors import to_device


def launched_tokens(seqs: list[Sequence], is_prefill: bool) -> int:
    """What :meth:`StepLoop.step` returns for a launched step: its prefill tokens, or minus its
    decode sequences."""
    return sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)


class InFlightStep:
    """A step launched without waiting: its sequences, whether it is a prefill step, the tokens it
    launched (positive for prefill, negative for decode, as :meth:`StepLoop.step` returns), its
    sampled tokens on the device (a decode step's: int64 ``[len(seqs)]``, the next step's input
    ids) and a host copy of its results, started at launch and read by :meth:`output`."""

    def __init__(self, seqs: list[Sequence], is_prefill: bool, sampled: SampledStep):
        self.seqs, self.is_prefill, self.tokens = seqs, is_prefill, sampled.tokens
        self.num_tokens = launched_tokens(seqs, is_prefill)
        self._host = sampled.to_host()
        self._copied = None
        if sampled.tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def input_ids(self, batch: list[Sequence]) -> torch.Tensor:
        """The tokens of ``batch`` (a subsequence of :attr:`seqs`), as the next step's input ids."""
        if len(batch) == len(self.seqs):
            return self.tokens
        rows = {seq.seq_id: row for row, seq in enumerate(self.seqs)}
        return self.tokens[to_device([rows[seq.seq_id] for seq in batch], torch.int64, self.tokens.device)]

    def output(self) -> StepOutput:
        """The step's results on the host (waits for the step and the copy)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.output()


class StepLoop:
    """Runs one engine step per :meth:`step`, synchronously or overlapped (module docstring).

    Args: the scheduler, the model runner, the seeded requests' generators (seq_id -> generator,
    the engine's dict: a finished request's is dropped here) and ``overlap``
    (``Config.async_scheduling``).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, generators: dict[int, torch.Generator],
                 overlap: bool):
        self.scheduler, self.runner, self.generators, self.overlap = scheduler, runner, generators, overlap
        self.in_flight: InFlightStep | None = None

    def step(self) -> tuple[list[Sequence], int]:
        """Launch the next step; return the sequences found finished (in this step, or with
        overlap in the step before) and the tokens launched (positive for prefill, negative for
        decode, 0 for none).

        Raises:
            RuntimeError: the scheduler could not schedule any sequence (KV cache too small).
        """
        finished = []
        if self.in_flight is not None:
            previous = self.in_flight
            batch = self._schedule_ahead(previous)
            self.in_flight = launched = self._launch_ahead(previous, batch) if batch else None
            finished = self._finish(previous.seqs, previous.output(), advanced=batch is not None)
            if launched is not None:
                if all(seq.is_finished for seq in launched.seqs):  # all stopped in `previous`: nothing to read
                    self.in_flight = None
                return finished, launched.num_tokens
        if self.scheduler.is_finished():
            return finished, 0
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            raise RuntimeError("the scheduler could not schedule any sequence (KV cache too small)")
        num_tokens = launched_tokens(seqs, is_prefill)
        sampled = self.runner.run(seqs, is_prefill, self.generators, self.scheduler.take_moves())
        if self.overlap:
            self.in_flight = InFlightStep(seqs, is_prefill, sampled)
            return finished, num_tokens
        return finished + self._finish(seqs, sampled.output()), num_tokens

    def _schedule_ahead(self, previous: InFlightStep) -> list[Sequence] | None:
        """The step after ``previous``, scheduled before its tokens are read (its sequences are
        advanced then), or None when the scheduler needs them (nothing was changed). A prefill
        step may have nothing to launch after it (an empty list)."""
        if previous.is_prefill:
            return self.scheduler.schedule_prefill_ahead(previous.seqs)
        return self.scheduler.schedule_decode_ahead(previous.seqs)

    def _launch_ahead(self, previous: InFlightStep, batch: list[Sequence]) -> InFlightStep:
        """Launch ``batch``, the step after ``previous``, before reading ``previous`` (a decode
        step's input ids are ``previous``'s tokens on the device)."""
        input_ids = None if previous.is_prefill else previous.input_ids(batch)
        sampled = self.runner.run(batch, previous.is_prefill, self.generators, self.scheduler.take_moves(),
                                  input_ids)
        return InFlightStep(batch, previous.is_prefill, sampled)

    def _finish(self, seqs: list[Sequence], out: StepOutput, advanced: bool = False) -> list[Sequence]:
        out.record(seqs)
        finished = self.scheduler.postprocess(seqs, out.token_ids, advanced)
        for seq in finished:
            self.generators.pop(seq.seq_id, None)
        return finished

    def drop_in_flight(self):
        """Forget the step in flight (its requests were aborted)."""
        self.in_flight = None
