"""What ``LLM.generate`` and ``LLM.chat`` return: vLLM's ``RequestOutput`` / ``CompletionOutput`` /
``Logprob``, readable nano-vLLM style as well (``out["text"]``, ``out["token_ids"]``)."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability (natural log, float) with its rank in the distribution (1 =
    most likely; tokens of higher log-probability + 1) and its text (the token decoded alone)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per generated token: {token_id: Logprob}
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's fields).

    Attributes:
        index: the completion's index among the request's ``n``.
        text: the detokenized output, cut at a matched stop string.
        token_ids: the generated token ids (stop tokens and the tokens of a stop string kept).
        cumulative_logprob: sum of the sampled tokens' log-probabilities; None unless the
            request asked for ``logprobs``.
        logprobs: per generated token ``{token_id: Logprob}``: the sampled token first, then the
            top-k; None unless the request asked for them.
        finish_reason: "stop" (eos, stop token or stop string), "length" (max_tokens or
            max_model_len) or "abort".
        stop_reason: the stop string or stop token id that ended it; None for eos and length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timings (vLLM's ``RequestMetrics``), in seconds of ``time.time()`` as the
    engine saw them on the host; with ``n`` > 1 the earliest (arrival, first scheduled, first
    token) or latest (last token, finished) over the completions.

    Attributes:
        arrival_time: the request was queued.
        first_scheduled_time: its first prefill step was scheduled.
        first_token_time: its first generated token reached the host.
        last_token_time: its last generated token reached the host.
        finished_time: it finished (None for a completion aborted before).
        time_in_queue: ``first_scheduled_time - arrival_time``.
    """

    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None


# Keys readable nano-vLLM style: out[key] reads outputs[0].key, or the request's own field.
_COMPLETION_KEYS = ("text", "token_ids", "finish_reason")
_REQUEST_KEYS = ("num_cached_tokens",)


@dataclass
class RequestOutput:
    """One request's result (vLLM's fields).

    Attributes:
        request_id: the request's id (a string, unique within the process).
        prompt: the prompt text; None when the prompt was given as token ids.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token ``{token_id: Logprob}`` (None for the first token);
            None unless the request asked for ``prompt_logprobs``.
        outputs: the ``n`` completions, in index order.
        finished: every completion has finished.
        num_cached_tokens: prompt tokens found in the prefix cache (of the first completion).
        metrics: the request's :class:`RequestMetrics` (left out of ``==``: two runs of a
            request are equal when their results are).

    ``out["text"]``, ``out["token_ids"]`` and ``out["finish_reason"]`` read ``outputs[0]``, and
    ``out["num_cached_tokens"]`` this request's field, so nano-vLLM's dict-style code keeps working.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = field(default=None, compare=False)  # timings: not part of equality

    def __getitem__(self, key: str):
        if key in _COMPLETION_KEYS:
            return getattr(self.outputs[0], key)
        if key in _REQUEST_KEYS:
            return getattr(self, key)
        raise KeyError(f"{key!r}: dict-style access reads {list(_COMPLETION_KEYS + _REQUEST_KEYS)}; "
                       f"use the attributes for the rest")

    def __contains__(self, key) -> bool:
        return key in _COMPLETION_KEYS + _REQUEST_KEYS

    def keys(self) -> tuple[str, ...]:
        return _COMPLETION_KEYS + _REQUEST_KEYS
