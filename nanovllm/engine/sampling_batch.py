"""One step's sampling, engine side: which hidden rows need logits (:class:`LogitRows`), the
batch's SamplingParams as device tensors (:func:`sampling_tensors`), and the step's results
(:class:`StepSampler` -> :class:`SampledStep` on the device -> :class:`StepOutput` per sequence).

Rank 0 samples. Under torchrun the other ranks take rank 0's tokens and logprobs by broadcast
(every rank's scheduler must see the same tokens); their shapes follow from the sequences' params,
which every rank has. Spawned tensor-parallel workers never get here (they return no tokens).
"""
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from nanovllm.sequence import PLACEHOLDER_TOKEN, LogprobEntry, Sequence
from nanovllm.layers.sampler import (FLOAT32_MAX, LogprobsTensors, Penalties, Sampler, SamplerOutput,
                                     SamplingTensors, compute_logprobs)
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tensors import to_device


def logprobs_width(k: int | None, vocab_size: int) -> int:
    """Top-k width of a ``logprobs`` / ``prompt_logprobs`` value (-1: the whole vocabulary)."""
    return vocab_size if k == -1 else min(k or 0, vocab_size)


class LogitRows:
    """The hidden-state rows of one step that get logits, computed from the sequences alone (on
    every rank: the LM head gathers across ranks, so all must ask for the same rows).

    ``indices`` (ascending): the sampled rows ``sample_idx`` and, in a prefill step, the rows
    whose next token is a prompt token of a request with ``prompt_logprobs`` still to collect.
    ``spans``: per such sequence ``(index in the batch, first position, number of rows)``.
    """

    def __init__(self, seqs: list[Sequence], sample_idx: list[int], is_prefill: bool):
        self.sample_idx, self.spans = sample_idx, []
        prompt_rows = []
        if is_prefill and any(seq.needs_prompt_logprobs for seq in seqs):
            offset = 0
            for i, seq in enumerate(seqs):
                start = seq.num_computed_tokens
                end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
                if seq.needs_prompt_logprobs and end > start:
                    prompt_rows += range(offset, offset + end - start)
                    self.spans.append((i, start, end - start))
                offset += seq.num_scheduled_tokens
        self.indices, self._sample_pos, self._prompt_pos = sample_idx, [], []
        if prompt_rows:
            self.indices = sorted(sample_idx + prompt_rows)
            where = {row: j for j, row in enumerate(self.indices)}
            self._sample_pos = [where[row] for row in sample_idx]
            self._prompt_pos = [where[row] for row in prompt_rows]

    def split(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits ``[len(indices), vocab]`` -> (rows to sample, rows of prompt logprobs or None)."""
        if not self._prompt_pos:
            return logits, None
        return (logits[to_device(self._sample_pos, torch.int64, logits.device)],
                logits[to_device(self._prompt_pos, torch.int64, logits.device)])


def _penalties(seqs: list[Sequence], rows: list[int], device, input_ids: torch.Tensor | None) -> Penalties:
    """The penalised ``rows``' tokens; a generated token still on the device (a placeholder,
    async scheduling) is the decode step's input id of its row, read from ``input_ids``."""
    params = [seq.sampling_params for seq in seqs]
    prompt_rows, prompt_tokens, output_rows, output_tokens, pending_rows = [], [], [], [], []
    for i in rows:
        seq = seqs[i]
        if params[i].repetition_penalty != 1.0:
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            prompt_rows += [i] * len(prompt)
            prompt_tokens += prompt
        output = seq.completion_token_ids
        if output and output[-1] == PLACEHOLDER_TOKEN:
            output = output[:-1]
            pending_rows.append(i)
        output_rows += [i] * len(output)
        output_tokens += output
    floats = [[min(p.repetition_penalty, FLOAT32_MAX), p.presence_penalty, p.frequency_penalty] for p in params]
    repetition, presence, frequency = to_device(floats, torch.float32, device).unbind(1)
    ints = partial(to_device, dtype=torch.int64, device=device)
    output_rows, output_tokens = ints(output_rows), ints(output_tokens)
    if pending_rows:
        pending = ints(pending_rows)
        output_rows, output_tokens = torch.cat([output_rows, pending]), torch.cat([output_tokens, input_ids[pending]])
    return Penalties(repetition, presence, frequency, (ints(prompt_rows), ints(prompt_tokens)),
                     (output_rows, output_tokens))


def banned_token_ids(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                     eos_token_ids) -> set[int]:
    """Token ids a request may not sample next, ``token_ids`` being its prompt (the first
    ``num_prompt_tokens``) and what it has generated: its eos and stop ids while below
    ``min_tokens``, and its bad words' last tokens (a one-token word always; a longer one when the
    output ends with the word's other tokens)."""
    generated = len(token_ids) - num_prompt_tokens
    banned = set()
    if generated < params.min_tokens:
        banned |= set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    for ids in params.bad_words_token_ids or ():
        if len(ids) == 1 or (generated >= len(ids) - 1 and token_ids[len(token_ids) - len(ids) + 1:] == ids[:-1]):
            banned.add(ids[-1])
    return banned


def nothing_to_sample(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int, eos_token_ids,
                      vocab_size: int) -> str | None:
    """Why a request can sample no token next (every token it may sample is banned by
    :func:`banned_token_ids`), or None when some token is left."""
    banned = {t for t in banned_token_ids(params, token_ids, num_prompt_tokens, eos_token_ids) if t < vocab_size}
    if params.allowed_token_ids is not None:
        if banned.issuperset(params.allowed_token_ids):
            return (f"every token of allowed_token_ids {sorted(set(params.allowed_token_ids))[:8]} is banned "
                    f"(bad words, or eos and stop ids below min_tokens={params.min_tokens}): no token can be sampled")
    elif len(banned) >= vocab_size:
        return f"bad words and stop ids ban all {vocab_size} tokens of the vocabulary: no token can be sampled"
    return None


def _banned(seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int, device):
    """(row, token) pairs that rows may not sample (:func:`banned_token_ids`; a longer bad word's
    last token is known on the host: ``Scheduler.schedule_decode_ahead`` does not run such rows
    ahead)."""
    rows, tokens = [], []
    for i, seq in enumerate(seqs):
        banned = sorted(t for t in banned_token_ids(seq.sampling_params, seq.token_ids, seq.num_prompt_tokens,
                                                    eos_token_ids) if t < vocab_size)
        rows += [i] * len(banned)
        tokens += banned
    if not rows:
        return None
    return to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device)


def _allowed(params: list[SamplingParams], device):
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not restricted:
        return None
    rows = [i for i in restricted for _ in params[i].allowed_token_ids]
    tokens = [t for i in restricted for t in params[i].allowed_token_ids]
    ints = partial(to_device, dtype=torch.int64, device=device)
    return ints(restricted), (ints(rows), ints(tokens))


def _bias(params: list[SamplingParams], device):
    rows, tokens, values = [], [], []
    for i, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            rows.append(i)
            tokens.append(token)
            values.append(value)
    if not rows:
        return None
    return ((to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device)),
            to_device(values, torch.float32, device))


def _logprob_rows(params: list[SamplingParams], vocab_size: int) -> tuple[list[int], int]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    return rows, max((logprobs_width(params[i].logprobs, vocab_size) for i in rows), default=0)


def sampling_tensors(seqs: list[Sequence], device: torch.device, eos_token_ids: list[int],
                     generators: dict[int, torch.Generator] | None, vocab_size: int,
                     input_ids: torch.Tensor | None = None) -> SamplingTensors:
    """The sampled sequences' params as :class:`SamplingTensors`: the host flags are computed once
    per batch from the params (no device sync), and a tensor is built only for a stage some row
    uses, so a batch with default params pays for nothing it does not use. ``input_ids``: a
    decode step's input ids on the device, row i sequence i's (the penalties read the tokens
    that are placeholders on the host there)."""
    params = [seq.sampling_params for seq in seqs]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    temperatures = top_k = top_p = min_p = None
    if sampled_rows:
        temperatures = to_device([1.0 if p.greedy else min(p.temperature, FLOAT32_MAX) for p in params],
                                  torch.float32, device)
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in sampled_rows):
            top_k = to_device([p.top_k for p in params], torch.int64, device)
            top_p = to_device([p.top_p for p in params], torch.float32, device)
        if any(params[i].min_p > 0 for i in sampled_rows):
            min_p = to_device([p.min_p for p in params], torch.float32, device)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    logprob_rows, num_logprobs = _logprob_rows(params, vocab_size)
    adjusted = any(p.adjusts_logits for p in params)
    return SamplingTensors(
        temperatures, top_k, top_p, min_p, sampled_rows,
        generators={row: generators[seq.seq_id] for row, seq in enumerate(seqs)
                    if generators and seq.seq_id in generators},
        penalties=_penalties(seqs, penalised, device, input_ids) if penalised else None,
        banned=(_banned(seqs, eos_token_ids, vocab_size, device)
                if adjusted or any(p.min_tokens for p in params) else None),
        logprob_rows=logprob_rows, num_logprobs=num_logprobs,
        allowed=_allowed(params, device) if adjusted else None, bias=_bias(params, device) if adjusted else None)


@dataclass
class StepOutput:
    """One step's results per sequence of the batch: ``token_ids`` (None for a prefill chunk that
    does not end its prompt), and, when some sequence asked for them, ``logprobs`` (the sampled
    token's entry, or None) and ``prompt_logprobs`` (this chunk's prompt entries, or None)."""

    token_ids: list[int | None]
    logprobs: list[LogprobEntry | None] | None = None
    prompt_logprobs: list[list[LogprobEntry] | None] | None = None

    def record(self, seqs: list[Sequence]) -> None:
        """Append the logprob entries to their sequences (not to a finished one: an overlapped
        step computed it once more after it stopped)."""
        for seq, entry in zip(seqs, self.logprobs or ()):
            if entry is not None and not seq.is_finished:
                seq.add_logprobs(entry)
        for seq, entries in zip(seqs, self.prompt_logprobs or ()):
            if entries is not None:
                seq.prompt_logprobs += entries


@dataclass
class SampledStep:
    """One step's sampler results, still where they were computed, and what is needed to hand
    them out per sequence: ``tokens`` int64 ``[number of sampled sequences]`` (the sequences
    with ``sampled[i]``, in batch order); ``logprobs`` of the sampled sequences that asked for
    them (``wants_logprobs[i]``), in order; ``prompt_logprobs``: the rows of ``spans`` (see
    :class:`LogitRows`). :meth:`output` reads them on the host (one device sync)."""

    tokens: torch.Tensor
    logprobs: LogprobsTensors | None
    prompt_logprobs: LogprobsTensors | None
    sampled: list[bool]
    wants_logprobs: list[bool]
    spans: list[tuple[int, int, int]]

    @staticmethod
    def unsampled(num_seqs: int) -> "SampledStep":
        """A step of prefill chunks that sample nothing."""
        return SampledStep(torch.empty(0, dtype=torch.int64), None, None, [False] * num_seqs, [False] * num_seqs, [])

    def to_host(self) -> "SampledStep":
        """A copy on the host, started without waiting (CUDA: into pinned memory; read it after
        the copies are done, e.g. after an event recorded behind them)."""
        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        def host_logprobs(lp: LogprobsTensors | None) -> LogprobsTensors | None:
            return None if lp is None else LogprobsTensors(*map(host, lp.tensors()))

        return SampledStep(host(self.tokens), host_logprobs(self.logprobs), host_logprobs(self.prompt_logprobs),
                           self.sampled, self.wants_logprobs, self.spans)

    def output(self) -> StepOutput:
        """The results per sequence as Python values (waits for the device unless on the host)."""
        tokens = iter(self.tokens.tolist())
        result = StepOutput([next(tokens) if s else None for s in self.sampled])
        if self.logprobs is not None:
            entries = iter(self.logprobs.tolist())
            result.logprobs = [next(entries) if s and w else None for s, w in zip(self.sampled, self.wants_logprobs)]
        if self.prompt_logprobs is not None:
            entries = self.prompt_logprobs.tolist()
            result.prompt_logprobs = [None] * len(self.sampled)
            offset = 0
            for i, _, n in self.spans:
                result.prompt_logprobs[i] = entries[offset:offset + n]
                offset += n
        return result


class StepSampler:
    """Turns one step's logits into a :class:`SampledStep` (see the module docstring).

    Args: the :class:`Sampler`; the engine's ``generator`` (rows without a seed); the model's eos
    ids (masked below ``min_tokens``); this process's ``rank``; ``broadcast``: torchrun
    tensor parallelism (rank 0's results are broadcast to every rank).
    """

    def __init__(self, sampler: Sampler, generator: torch.Generator, eos_token_ids: list[int],
                 rank: int, broadcast: bool):
        self.sampler, self.generator, self.eos_token_ids = sampler, generator, eos_token_ids
        self.rank, self.broadcast = rank, broadcast

    def __call__(self, logits: torch.Tensor, rows: LogitRows, seqs: list[Sequence], sampled: list[bool],
                 generators: dict[int, torch.Generator] | None, input_ids: torch.Tensor | None = None) -> SampledStep:
        """``logits`` ``[len(rows.indices), vocab]``; ``sampled[i]``: sequence i gets a token;
        ``input_ids``: the step's input ids on the device (see :func:`sampling_tensors`)."""
        sampled_seqs = [seq for seq, s in zip(seqs, sampled) if s]
        sample_logits, prompt_logits = rows.split(logits)
        vocab = logits.size(-1)
        out = self._sample(sample_logits, sampled_seqs, generators, vocab, input_ids)
        prompt = self._prompt_logprobs(prompt_logits, rows, seqs, vocab)
        if self.broadcast:  # every rank knows the shapes, so all skip the same empty tensors
            for t in (out.tokens, *(out.logprobs.tensors() if out.logprobs else ()),
                      *(prompt.tensors() if prompt else ())):
                if t.numel():
                    dist.broadcast(t, src=0)
        return SampledStep(out.tokens, out.logprobs, prompt, sampled,
                           [seq.sampling_params.logprobs is not None for seq in seqs], rows.spans)

    def _sample(self, logits, seqs: list[Sequence], generators, vocab: int, input_ids) -> SamplerOutput:
        device = logits.device
        if not seqs:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=device), None)
        if self.rank == 0:
            params = sampling_tensors(seqs, device, self.eos_token_ids, generators, vocab, input_ids)
            return self.sampler(logits, params, self.generator)
        rows, k = _logprob_rows([seq.sampling_params for seq in seqs], vocab)
        return SamplerOutput(torch.empty(len(seqs), dtype=torch.int64, device=device),
                             LogprobsTensors.empty(len(rows), k, device) if rows else None)

    def _prompt_logprobs(self, logits, rows: LogitRows, seqs: list[Sequence], vocab: int):
        if not rows.spans:
            return None
        k = max(logprobs_width(seqs[i].num_prompt_logprobs, vocab) for i, _, _ in rows.spans)
        if self.rank > 0:
            return LogprobsTensors.empty(logits.size(0), k, logits.device)
        targets = [t for i, start, n in rows.spans for t in seqs[i].token_ids[start + 1:start + 1 + n]]
        return compute_logprobs(logits, to_device(targets, torch.int64, logits.device), k)
