"""Per-request sampling parameters, with vLLM's meanings."""
from dataclasses import dataclass, field


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
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
