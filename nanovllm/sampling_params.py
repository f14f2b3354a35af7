"""Per-request sampling parameters, with vLLM's meanings."""
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def is_integer(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(name: str, value):
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value, limit: str):
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {limit}, got {value!r}")


@dataclass
class SamplingParams:
    """How one request is decoded.

    Attributes:
        temperature: softmax temperature; ``0`` means exact greedy argmax. Must be >= 0.
        top_p: nucleus sampling mass in (0, 1]; ``1`` disables it.
        top_k: keep the k most likely tokens; ``-1`` (or 0) disables it.
        max_tokens: number of tokens to generate, >= 1.
        ignore_eos: keep generating past end-of-sequence tokens.
        stop_token_ids: extra token ids that end the request (the token is kept in the output).
        seed: per-request random seed; ``None`` draws from the engine's generator.

    Raises:
        ValueError: a field outside its range, naming the field, the value and the limit.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self):
        _check_number("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p, "in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of integer token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(is_integer(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integer token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and not (is_integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
