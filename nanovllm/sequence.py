"""A request's token ids and its progress through prefill and decode."""
import time
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

# One token's logprobs as the sampler returns them: (token ids: the token itself then the top-k,
# their log-probabilities, the token's rank); turned into vLLM's Logprob dicts for the output.
LogprobEntry = tuple[list[int], list[float], int]

# Holds the place of a token sampled by a step still running on the device (async scheduling,
# ``nanovllm.engine.step_loop``): the next step reads the token on the device; the host fills it in
# one step later. Never a vocabulary id, so a step that read it from the host would fail loudly.
PLACEHOLDER_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class _TokenWindow:
    """A sequence's token ids as a tensor-parallel worker sees them: the full length, and only
    the tokens of the current step (a prefill chunk, or the last token for decode)."""

    __slots__ = ("length", "start", "tokens")

    def __init__(self, token_ids: list[int], start: int, end: int):
        self.length, self.start, self.tokens = len(token_ids), start, token_ids[start:end]

    def __len__(self):
        return self.length

    def __reduce__(self):
        return _token_window, (self.length, self.start, self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1 or start < self.start or stop > self.start + len(self.tokens):
                raise IndexError(f"tokens {start}:{stop} are outside this step's window")
            return self.tokens[start - self.start:stop - self.start]
        return self.tokens[index % self.length - self.start]


def _token_window(length: int, start: int, tokens: list[int]) -> _TokenWindow:
    window = _TokenWindow.__new__(_TokenWindow)
    window.length, window.start, window.tokens = length, start, tokens
    return window


class Sequence:
    """One request: prompt + generated token ids, its block tables (one per KV tier) and its KV
    progress.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix-cache hits
    included); prefill advances it chunk by chunk, decode by one per step.
    ``num_scheduled_tokens`` is what the current step computes.
    """

    _counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.block_table: list[int] = []  # GPU-tier block of each logical block, -1 when on the host
        self.host_block_table: list[int] = []  # host-tier block of each logical block, -1 when on the GPU
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.samples_token = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.detokenizer = None  # an IncrementalDetokenizer when the request has stop strings
        self.num_prompt_logprobs = sampling_params.prompt_logprobs
        self.logprobs: list[LogprobEntry] = []  # per generated token, when asked for
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[LogprobEntry] = []  # per prompt token after the first
        # time.time() seconds (vLLM's RequestMetrics): queued, first scheduled, first and last token
        # known on the host, finished; None until it happens
        self.arrival_time = time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self):
        return len(self.token_ids)

    # What a spawned tensor-parallel worker reads to build a step's inputs; it never samples.
    _WORKER_FIELDS = ("seq_id", "num_prompt_tokens", "block_size", "block_table", "host_block_table",
                      "num_cached_tokens", "num_computed_tokens", "num_scheduled_tokens", "samples_token",
                      "num_prompt_logprobs")

    def __getstate__(self):
        """Pickled for the spawned TP workers each step, on the step's critical path: only this
        step's tokens (not the history) and the fields in ``_WORKER_FIELDS``, as a flat tuple."""
        start = self.num_computed_tokens
        window = _TokenWindow(self.token_ids, start, start + max(self.num_scheduled_tokens, 1))
        return window, *(getattr(self, name) for name in self._WORKER_FIELDS)

    def __setstate__(self, state):
        self.token_ids = state[0]
        for name, value in zip(self._WORKER_FIELDS, state[1:]):
            setattr(self, name, value)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and they are not collected yet (they are, once
        the prompt is prefilled: a preempted sequence recomputes without them)."""
        return self.num_prompt_logprobs is not None and self.num_completion_tokens == 0

    def add_logprobs(self, entry: LogprobEntry):
        self.logprobs.append(entry)
        self.cumulative_logprob += entry[1][0]

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def fill_token(self, token_id: int):
        """Replace the trailing placeholder with the sampled ``token_id``."""
        self.token_ids[-1] = token_id

    def schedule(self, num_tokens: int):
        """The next step computes ``num_tokens`` tokens from ``num_computed_tokens``; it samples a
        token (:attr:`samples_token`) when it reaches the last token: a decode step, or the prefill
        chunk that completes the prompt. Decided here, once, and read by the scheduler, the step
        inputs and the sampler."""
        self.num_scheduled_tokens = num_tokens
        self.samples_token = self.num_computed_tokens + num_tokens >= len(self.token_ids)

    def computed(self):
        """The scheduled tokens' KV is in the cache: they count as computed."""
        self.num_computed_tokens += self.num_scheduled_tokens
        self.num_scheduled_tokens = 0
        self.samples_token = False

    def reset_for_recompute(self):
        """Forget all KV progress (preemption by recomputation)."""
        self.status = SequenceStatus.WAITING
        self.block_table, self.host_block_table = [], []
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.samples_token = False
