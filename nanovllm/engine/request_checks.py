"""Everything a request is checked against before it is queued, so that a bad request raises at
once and the engine keeps serving the others: prompts (tokenized here) against the vocabulary,
``max_model_len`` and the KV cache's capacity, SamplingParams against the vocabulary."""
from nanovllm.engine.prompts import Prompt
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.checks import is_integer


class RequestChecker:
    """Args: the tokenizer; vocab_size; max_model_len; kv_capacity (tokens both KV tiers hold,
    the smallest over the data-parallel replicas)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv_capacity: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_model_len, self.kv_capacity = max_model_len, kv_capacity

    def token_ids(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        """The prompt's token ids (its text tokenized when it has none), checked; errors start
        with ``name`` (``prompts[i]`` in a batch).

        Raises:
            ValueError: empty, longer than ``max_model_len``, a non-integer id or one outside the
                vocabulary. RuntimeError: more tokens than the KV cache holds.
        """
        ids = self.tokenizer.encode(prompt.text) if prompt.token_ids is None else prompt.token_ids
        if not ids:
            raise ValueError(f"{name} is empty (0 tokens); at least 1 token is required")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{name} has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if not all(type(t) is int for t in ids):  # plain ints (the usual case) skip the slower check
            not_int = [t for t in ids if not is_integer(t)]
            if not_int:
                raise ValueError(f"{name}: token id {not_int[0]!r} is not an integer")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.kv_capacity:
            raise RuntimeError(f"{name} has {len(ids)} tokens but the KV cache holds {self.kv_capacity}")
        return ids

    def params(self, params, name: str) -> SamplingParams:
        """A validated copy of ``params`` to queue (every field checked again, so an edit made
        after construction is caught), with the checks that need the model's vocabulary.

        Raises:
            ValueError: not a SamplingParams; a bad field; stop ids or logprobs beyond the
                vocabulary (each naming ``name``).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{name} must be a SamplingParams, got {type(params).__name__}")
        try:
            params = params.clone()
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{name}: stop_token_ids has token id {bad[0]}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}: {field}={k} is more than the vocabulary's {self.vocab_size} tokens")
        return params

    def params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        """``generate``'s ``sampling_params`` (None, one for all, or one per prompt) as one
        checked copy per prompt.

        Raises:
            ValueError: a list of another length than the prompts'; as :meth:`params`.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            return [self.params(sampling_params, "sampling_params")] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompt(s): "
                             "give one SamplingParams for all or one per prompt")
        return [self.params(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]
