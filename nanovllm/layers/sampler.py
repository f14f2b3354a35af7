"""Token sampling for a batch of rows with mixed parameters, on the device, following vLLM's V1
sampler: raw log-probabilities, penalties, logit bias, allowed-token masks, min_tokens and
bad-word masks, greedy argmax, then temperature, min-p, top-k / top-p and the exponential race. Every stage is a whole-batch tensor op and is
skipped when no row of the batch uses it (the host flags of :class:`SamplingTensors`)."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.ops.backend import interpreted, use_triton
from nanovllm.ops.sample_race import SEED_HIGH, sample_race
from nanovllm.utils.tensors import to_device

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class Penalties:
    """Per-row penalties (vLLM's ``apply_penalties``) and the tokens they count.

    ``repetition``, ``presence``, ``frequency``: float32 ``[rows]`` (1, 0, 0 for rows without).
    ``prompt``, ``output``: (row index int64 ``[m]``, token id int64 ``[m]``) pairs listing each
    row's prompt tokens and generated tokens (with repeats; empty for rows without penalties).
    """

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    prompt: tuple[torch.Tensor, torch.Tensor]
    output: tuple[torch.Tensor, torch.Tensor]


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sampled sequence.

    Device tensors: ``temperatures`` float32 ``[rows]`` (greedy rows hold 1.0, unused);
    ``top_k`` int64 and ``top_p`` float32 ``[rows]`` (None when no sampled row filters);
    ``min_p`` float32 ``[rows]`` (None when no sampled row uses it). Host values, computed once
    per batch so that unused stages cost nothing: ``sampled_rows`` (rows with temperature >=
    1e-5; the others take the argmax), ``generators`` (row -> the request's seeded generator),
    ``penalties`` (None when no row has any), ``banned`` ((row, token id) int64 pairs masked to
    -inf before sampling: eos and stop ids of rows below ``min_tokens``; None when none),
    ``logprob_rows`` (rows whose request asked for logprobs) and ``num_logprobs`` (top-k width
    returned for them: the largest k asked in the batch). ``allowed`` (None when no row restricts
    its tokens): (restricted rows int64 ``[r]``, (row, token id) int64 ``[m]`` pairs of the tokens
    those rows may sample); ``bias``: (row, token id) int64 ``[m]`` and the float32 ``[m]``
    biases added there (None when no row has a logit bias). Bad words are ``banned`` pairs.
    """

    temperatures: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    sampled_rows: list[int]
    generators: dict[int, torch.Generator]
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    logprob_rows: list[int] | None = None
    num_logprobs: int = 0
    allowed: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
    bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@dataclass
class LogprobsTensors:
    """vLLM's ``LogprobsTensors``: per row, ``token_ids`` int64 ``[rows, 1 + k]`` (column 0 the
    sampled or prompt token, then the top-k in descending order), their ``logprobs`` float32
    ``[rows, 1 + k]`` (natural log), and ``ranks`` int64 ``[rows]`` of column 0's token (1 + the
    number of tokens with a higher log-probability)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    @staticmethod
    def empty(rows: int, k: int, device) -> "LogprobsTensors":
        """Uninitialised tensors of the shapes ``compute_logprobs`` returns (for a broadcast)."""
        return LogprobsTensors(torch.empty(rows, 1 + k, dtype=torch.int64, device=device),
                               torch.empty(rows, 1 + k, dtype=torch.float32, device=device),
                               torch.empty(rows, dtype=torch.int64, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.token_ids, self.logprobs, self.ranks

    def tolist(self) -> list[tuple[list[int], list[float], int]]:
        """Per row ``(token ids, logprobs, rank)`` as Python values (one device sync)."""
        return list(zip(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()))


@dataclass
class SamplerOutput:
    """``tokens`` int64 ``[rows]`` and, when some row asked for them, the logprobs of the rows in
    ``SamplingTensors.logprob_rows`` (in that order)."""

    tokens: torch.Tensor
    logprobs: LogprobsTensors | None


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """log_softmax of ``logits`` float ``[rows, vocab]``: the entries of ``token_ids`` int64
    ``[rows]``, their ranks, and the top-``k`` tokens (vLLM's ``gather_logprobs``)."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(-1) + 1
    top = logprobs.topk(k, dim=-1)
    return LogprobsTensors(torch.cat([token_ids.unsqueeze(1), top.indices], 1),
                           torch.cat([chosen, top.values], 1), ranks)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (multiplicative, as transformers'
    ``RepetitionPenaltyLogitsProcessor``), then frequency and presence penalties over output
    tokens (additive, OpenAI's definition): ``logit - frequency * count - presence * (count > 0)``.
    Out of place; results are clamped to float32's finite range, so no value becomes -inf."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=logits.device)
    counts.index_put_(penalties.output, torch.ones_like(penalties.output[1], dtype=torch.float32),
                      accumulate=True)
    generated = counts > 0
    seen = generated.index_put(penalties.prompt, torch.ones_like(penalties.prompt[1], dtype=torch.bool))
    rep = penalties.repetition.unsqueeze(1)
    penalised = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * counts - penalties.presence.unsqueeze(1) * generated
    return logits.clamp(-FLOAT32_MAX, FLOAT32_MAX)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf the tokens whose probability is below ``min_p`` times the row's largest
    (vLLM's ``MinPLogitsProcessor``; ``min_p`` 0 keeps every token)."""
    probs = logits.softmax(-1)
    drop = probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (vLLM's semantics)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_allowed(logits: torch.Tensor, restricted: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor]):
    """-inf everywhere in the ``restricted`` rows but at the ``allowed`` (row, token) pairs
    (vLLM's ``allowed_token_ids``); out of place."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[restricted] = True
    blocked[allowed] = False
    return logits.masked_fill(blocked, float("-inf"))


def temperature_only(params: SamplingTensors) -> bool:
    """True when the batch needs nothing but greedy rows and temperature: no penalties, banned
    or allowed tokens, logit bias, min-p, top-k / top-p or logprobs (read from the host flags,
    no device sync)."""
    return (params.penalties is None and params.banned is None and params.min_p is None
            and params.top_k is None and params.top_p is None and not params.logprob_rows
            and params.allowed is None and params.bias is None)


class Sampler(nn.Module):
    """logits float ``[rows, vocab]`` + :class:`SamplingTensors` -> :class:`SamplerOutput`.

    Sampled rows use the exponential race (Gumbel-max equivalent): argmax(p / E), E ~ Exp(1),
    drawn from the row's own generator when its request has a seed, else from ``generator`` (the
    engine's). Greedy rows take the exact argmax of the penalised, masked logits. Logprobs come
    from the logits as given (before penalties and temperature: vLLM's "raw_logprobs").

    Fused path: a batch that is :func:`temperature_only` is sampled by one Triton kernel
    (:func:`nanovllm.ops.sample_race.sample_race`) reading the logits in their own dtype, with
    Philox noise keyed per row: a seeded request's row takes one seed per step from its
    generator, the other rows one seed each from a single draw of ``generator`` per step. Other
    batches run the torch stages, and there the race over the kept tokens is the same kernel with
    the same seeds, so that a seeded request samples the same tokens whichever path its batch
    takes. Taken on CUDA when Triton is installed (``fused=None``); ``fused=True`` also takes it
    under Triton's interpreter (tests), ``fused=False`` never (the torch path with
    ``exponential_`` noise, as on CPU).
    """

    def __init__(self, fused: bool | None = None):
        super().__init__()
        self.fused = fused

    def forward(self, logits: torch.Tensor, params: SamplingTensors,
                generator: torch.Generator | None = None) -> SamplerOutput:
        fused = self._fuses(logits)
        if fused and temperature_only(params):
            return SamplerOutput(self._sample_fused(logits, params, generator), None)
        raw = logits = logits.float()
        if params.penalties is not None:
            logits = apply_penalties(logits, params.penalties)
        if params.bias is not None:  # before the masks, so that clamping never lifts a -inf
            logits = logits.index_put(params.bias[0], params.bias[1], accumulate=True).clamp(-FLOAT32_MAX, FLOAT32_MAX)
        if params.allowed is not None:
            logits = apply_allowed(logits, *params.allowed)
        if params.banned is not None:
            logits = logits.index_put(params.banned, logits.new_full((), float("-inf")))
        tokens = logits.argmax(-1)
        if params.sampled_rows:
            tokens = self._sample(logits, tokens, params, generator, fused)
        return SamplerOutput(tokens, self._logprobs(raw, tokens, params))

    def _fuses(self, logits: torch.Tensor) -> bool:
        if self.fused is None:
            return use_triton(logits) and not interpreted(logits)
        return self.fused and use_triton(logits)

    @staticmethod
    def _sample_fused(logits: torch.Tensor, params: SamplingTensors, generator) -> torch.Tensor:
        rows = logits.size(0)
        if not params.sampled_rows:
            return sample_race(logits, None, None)
        temperatures = params.temperatures
        if len(params.sampled_rows) < rows:  # greedy rows get temperature 0
            sampled = set(params.sampled_rows)
            mask = to_device([row in sampled for row in range(rows)], torch.bool, logits.device)
            temperatures = temperatures.where(mask, 0.0)
        return sample_race(logits, temperatures, Sampler._seeds(params, rows, logits.device, generator))

    @staticmethod
    def _seeds(params: SamplingTensors, rows: int, device, generator) -> torch.Tensor:
        """int64 ``[rows]`` Philox seeds of one step: one draw of ``generator`` for the batch, and
        for each sampled row with its own generator one draw of that generator (so its tokens
        depend on its seed alone)."""
        seeds = torch.randint(SEED_HIGH, (rows,), generator=generator, device=device)
        for row in params.sampled_rows:
            if row in params.generators:
                gen = params.generators[row]
                seeds[row] = torch.randint(SEED_HIGH, (), generator=gen, device=gen.device)
        return seeds

    @staticmethod
    def _sample(logits, greedy_tokens, params: SamplingTensors, generator, fused: bool) -> torch.Tensor:
        rows = params.sampled_rows
        index = to_device(rows, torch.int64, logits.device)
        kept, temperatures = logits[index], params.temperatures[index]
        # softmax(kept / T) with the row's largest logit subtracted first: a small temperature
        # then sends unlikely tokens to -inf instead of the likely ones to +inf (NaN probabilities)
        scaled = (kept - kept.amax(-1, keepdim=True)) / temperatures.unsqueeze(1)
        if params.min_p is not None:
            scaled = apply_min_p(scaled, params.min_p[index])
        if params.top_k is not None:
            scaled = _apply_top_k_top_p(scaled, params.top_k[index], params.top_p[index])
        tokens = greedy_tokens.clone()
        if fused:  # the fused path's race over the kept tokens: a row draws what it would draw there
            kept = kept.masked_fill(scaled == float("-inf"), float("-inf"))
            seeds = Sampler._seeds(params, logits.size(0), logits.device, generator)[index]
            tokens[index] = sample_race(kept, temperatures, seeds)
            return tokens
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, row in enumerate(rows):
            if row in params.generators:
                gen = params.generators[row]
                noise[i] = torch.empty(probs.size(1), device=gen.device).exponential_(generator=gen)
        tokens[index] = (probs / noise).argmax(-1)
        return tokens

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: SamplingTensors) -> LogprobsTensors | None:
        rows = params.logprob_rows
        if not rows:
            return None
        if len(rows) < raw.size(0):
            index = to_device(rows, torch.int64, raw.device)
            raw, tokens = raw[index], tokens[index]
        return compute_logprobs(raw, tokens, params.num_logprobs)
