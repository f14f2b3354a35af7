"""Per-request sampling parameters, with vLLM's names, defaults and meanings."""
import math
from dataclasses import dataclass, field, fields
from numbers import Real

from nanovllm.utils.checks import check_bool, is_integer

SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)


def _check_int(name: str, value, low: int, limit: str):
    if not is_integer(value) or value < low:
        raise ValueError(f"{name} must be an integer {limit}, got {value!r}")


def _check_number(name: str, value, limit: str):
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {limit}, got {value!r}")


def _check_logprobs(name: str, value):
    if value is not None and not (is_integer(value) and value >= -1):
        raise ValueError(f"{name} must be None, an integer >= 0 (top-k) or -1 (the whole vocabulary), "
                         f"got {value!r}")


def _checked_list(name: str, value, item_ok, item_kind: str) -> list:
    """``value`` as a new list whose items pass ``item_ok``, else ValueError naming ``name``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of {item_kind}, got {value!r}")
    items = list(value)
    bad = [v for v in items if not item_ok(v)]
    if bad:
        raise ValueError(f"{name} must be a list of {item_kind}, got {bad[0]!r} in {items!r}")
    return items


@dataclass(kw_only=True)
class SamplingParams:
    """How one request is decoded; names, defaults and meanings are vLLM's (``vllm.SamplingParams``)
    except ``max_tokens``, whose default stays nano-vLLM's 64 (vLLM's is 16).

    Attributes:
        temperature: softmax temperature, >= 0; below 1e-5 (vLLM's epsilon) decoding is greedy
            (exact argmax of the penalised logits).
        top_p: nucleus sampling mass in (0, 1]; ``1`` disables it.
        top_k: keep the k most likely tokens; ``-1`` (or 0) disables it.
        max_tokens: tokens to generate, >= 1; ``None`` generates up to ``max_model_len``.
        ignore_eos: keep generating past end-of-sequence tokens.
        stop_token_ids: token ids that end the request (kept in ``token_ids``); checked against
            the vocabulary when the request is queued.
        seed: per-request random seed; ``None`` draws from the engine's generator. With ``n > 1``
            completion ``i`` uses ``seed + i`` (vLLM's rule).
        n: completions per prompt, >= 1, returned together in one ``RequestOutput``.
        stop: strings that end the request when they appear in the detokenized output (across
            token boundaries); the text is cut before the stop string unless
            ``include_stop_str_in_output``. A single string is taken as a list of one.
        include_stop_str_in_output: keep the matched stop string in ``text``.
        min_tokens: end-of-sequence, ``stop_token_ids`` and ``stop`` are ignored (eos and stop ids
            are masked from sampling) until this many tokens are generated; <= max_tokens.
        presence_penalty: subtracted from the logit of every token already generated, in [-2, 2]
            (OpenAI's definition).
        frequency_penalty: subtracted from a token's logit once per time it was generated, in
            [-2, 2] (OpenAI's definition).
        repetition_penalty: > 0; logits of tokens in the prompt or the output are divided by it
            when positive and multiplied by it when negative (CTRL, Keskar et al. 2019; as
            transformers' ``RepetitionPenaltyLogitsProcessor``); ``1`` disables it.
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the
            most likely token's, in [0, 1]; ``0`` disables it.
        logprobs: per generated token, the log-probabilities of the sampled token and of the
            ``logprobs`` most likely tokens (``-1``: every token), from the model's distribution
            before penalties, temperature, top-k, top-p and min-p (vLLM's default
            "raw_logprobs"); ``None`` returns none.
        prompt_logprobs: the same for every prompt token after the first (the first is None).
            Such a request takes no prefix-cache hits: a cached position has no logits.
        skip_special_tokens: leave special tokens out of ``text`` (``token_ids`` keeps them).
        detokenize: False leaves ``text`` empty (and logprobs' ``decoded_token`` None); token ids
            and logprobs are returned as usual. Stop strings need it True.
        spaces_between_special_tokens: passed to the tokenizer's ``decode`` (slow tokenizers put
            spaces between special tokens; fast ones ignore it).
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1; -1: the last
            ``max_model_len``), applied before the prompt is checked; ``prompt_token_ids`` of the
            output are the kept ones.
        allowed_token_ids: non-empty list of the only token ids that may be sampled (every other
            logit is -inf); ids are checked against the vocabulary when the request is queued.
        bad_words: strings never generated: each is tokenized with and without a leading space
            (vLLM's rule); a word of one token is masked at every step, a longer one's last token
            is masked when the output ends with its other tokens.
        bad_words_token_ids: token sequences never generated, as ``bad_words`` but given as ids
            (non-empty lists of ids >= 0, checked against the vocabulary when the request is
            queued); the engine adds the sequences of ``bad_words`` to them.
        logit_bias: ``{token id: bias}`` added to the logits (after penalties, before sampling;
            string keys are read as ints, as vLLM's ``from_optional``); finite biases, clamped to
            float32's range.
        best_of: None or ``n`` (beam search and best-of-n are not supported).
        logits_processors, structured_outputs, guided_decoding: None (not supported).
        flat_logprobs: False (logprobs are vLLM's dicts). output_kind, extra_args, skip_clone:
            accepted and not used (offline generation returns final outputs only).

    Every field is keyword-only: vLLM's first field is ``n`` and nano-vLLM's ``temperature``, so a
    positional value would mean different things to code ported from each (``TypeError``).

    Masks and bias run on the device for the whole batch, like the penalties; a batch whose
    requests use none of them skips them.

    Raises:
        ValueError: a field of the wrong type or outside its range, naming the field, the value
            and the limit; the engine checks every field again when the request is queued, and
            refuses masks that leave the first token nothing to sample (``allowed_token_ids`` all
            bad words, or all eos and stop ids under ``min_tokens``). A longer bad word that bans
            the last allowed tokens later raises RuntimeError from ``generate``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    best_of: int | None = field(default=None, repr=False)
    logits_processors: object = field(default=None, repr=False)
    structured_outputs: object = field(default=None, repr=False)
    guided_decoding: object = field(default=None, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    output_kind: object = field(default=None, repr=False)
    extra_args: dict | None = field(default=None, repr=False)
    skip_clone: bool = field(default=False, repr=False)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._check_sampling()
        self._check_lengths()
        self._check_penalties()
        self._check_outputs()
        self._check_logit_processors()
        self._check_unsupported()
        if self.top_k == 0:
            self.top_k = -1

    def _check_sampling(self):
        _check_number("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p, "in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check_number("min_p", self.min_p, "in [0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (is_integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        _check_int("n", self.n, 1, ">= 1")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(f"seed + n - 1 must be <= {SEED_MAX} (completion i uses seed + i), got "
                             f"seed={self.seed}, n={self.n}")

    def _check_lengths(self):
        if self.max_tokens is not None:
            if not is_integer(self.max_tokens):
                raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
            if self.max_tokens <= 0:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens, 0, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        check_bool("ignore_eos", self.ignore_eos)
        self.stop_token_ids = _checked_list("stop_token_ids", self.stop_token_ids,
                                       lambda t: is_integer(t) and t >= 0, "integer token ids >= 0")
        self.stop = _checked_list("stop", self.stop, lambda s: isinstance(s, str) and s != "",
                             "non-empty strings")
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)

    def _check_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]")
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty, "> 0")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _check_outputs(self):
        _check_logprobs("logprobs", self.logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        for name in ("skip_special_tokens", "detokenize", "spaces_between_special_tokens", "flat_logprobs",
                     "skip_clone"):
            check_bool(name, getattr(self, name))
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True (they are matched in the text)")
        k = self.truncate_prompt_tokens
        if k is not None and not (is_integer(k) and (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, an integer >= 1 or -1 (max_model_len), got {k!r}")

    def _check_logit_processors(self):
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _checked_list("allowed_token_ids", self.allowed_token_ids,
                                                   lambda t: is_integer(t) and t >= 0, "integer token ids >= 0")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.bad_words is not None:
            self.bad_words = _checked_list("bad_words", self.bad_words, lambda w: isinstance(w, str) and w.strip(),
                                           "non-blank strings")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [
                _checked_list("bad_words_token_ids", ids, lambda t: is_integer(t) and t >= 0, "integer token ids >= 0")
                for ids in _checked_list("bad_words_token_ids", self.bad_words_token_ids,
                                         lambda ids: not isinstance(ids, (str, bytes)) and hasattr(ids, "__len__")
                                         and len(ids) > 0, "non-empty lists of token ids")]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r:.80}")
            bias = {}
            for token, value in self.logit_bias.items():
                key = int(token) if isinstance(token, str) and token.strip().lstrip("-").isdigit() else token
                if not is_integer(key) or key < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                _check_number(f"logit_bias[{key}]", value, "(a logit bias)")
                bias[int(key)] = float(value)
            self.logit_bias = bias

    def _check_unsupported(self):
        """vLLM's fields for what nanovllm does not do: only their "off" values."""
        if self.best_of is not None and not (is_integer(self.best_of) and self.best_of == self.n):
            raise ValueError(f"best_of={self.best_of!r} is not supported (best-of-n and beam search); use None or n")
        for name, kind in (("logits_processors", "custom logits processors"),
                           ("structured_outputs", "structured outputs"), ("guided_decoding", "guided decoding")):
            if getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r:.80} is not supported ({kind}); use None")
        if self.flat_logprobs:
            raise ValueError("flat_logprobs=True is not supported: logprobs are lists of {token_id: Logprob}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be None or a dict, got {self.extra_args!r:.80}")

    def clone(self) -> "SamplingParams":
        """A validated copy made from the current field values (the engine queues this copy, so
        a field edited after construction is checked, and later edits do not reach the request).

        Raises:
            ValueError: as the constructor.
        """
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def greedy(self) -> bool:
        """Temperature below vLLM's epsilon 1e-5: the exact argmax is taken."""
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Some of ``allowed_token_ids``, ``logit_bias`` or bad words is set."""
        return self.allowed_token_ids is not None or bool(self.logit_bias) or bool(self.bad_words_token_ids)

    @property
    def has_multi_token_bad_words(self) -> bool:
        """A bad word of several tokens: its mask depends on the last generated tokens."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
