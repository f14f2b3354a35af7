"""Everything a request is checked against before it is queued, so that a bad request raises at
once and the engine keeps serving the others: prompts (tokenized here) against the vocabulary,
``max_model_len`` and the KV cache's capacity, SamplingParams against the vocabulary."""
from nanovllm.engine.prompts import Prompt, check_text
from nanovllm.engine.sampling_batch import nothing_to_sample
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.checks import is_integer


class RequestChecker:
    """Args: the tokenizer; vocab_size; max_model_len; kv_capacity (tokens both KV tiers hold,
    the smallest over the data-parallel replicas); max_logprobs (the most logprobs a request may
    ask for, -1: no limit); eos_token_ids (the model's, masked below ``min_tokens``)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv_capacity: int, max_logprobs: int,
                 eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_model_len, self.kv_capacity = max_model_len, kv_capacity
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids

    def token_ids(self, prompt: Prompt, name: str = "prompt", truncate: int | None = None) -> list[int]:
        """The prompt's token ids (its text tokenized when it has none), checked; errors start
        with ``name`` (``prompts[i]`` in a batch). ``truncate``: keep the last k ids
        (SamplingParams.truncate_prompt_tokens; -1: the last ``max_model_len``).

        Raises:
            ValueError: text that is not valid Unicode (a lone surrogate); empty, longer than
                ``max_model_len``, a non-integer id or one outside the vocabulary; ``truncate``
                above ``max_model_len``. RuntimeError: more tokens than the KV cache holds.
        """
        if prompt.token_ids is None:
            check_text(prompt.text, name)
            ids = self.tokenizer.encode(prompt.text)
        else:
            ids = prompt.token_ids
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ValueError(f"{name}: truncate_prompt_tokens={truncate} is more than max_model_len="
                                 f"{self.max_model_len}")
            ids = list(ids[-(self.max_model_len if truncate == -1 else truncate):])
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
                vocabulary, or more logprobs than ``max_logprobs``; masks that leave the first
                token nothing to sample (``allowed_token_ids`` all bad words, or all eos and stop
                ids under ``min_tokens``); each naming ``name``.
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
        given_bad = [t for ids in params.bad_words_token_ids or () for t in ids]
        for field, ids in (("allowed_token_ids", params.allowed_token_ids or ()), ("logit_bias", params.logit_bias or ()),
                           ("bad_words_token_ids", given_bad)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: {field} has token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words:
            given = params.bad_words_token_ids or []
            params.bad_words_token_ids = given + [ids for ids in self.bad_words_token_ids(params.bad_words)
                                                  if ids not in given]
        why = nothing_to_sample(params, [], 0, self.eos_token_ids, self.vocab_size)
        if why:
            raise ValueError(f"{name}: {why}")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is None:
                continue
            if k > self.vocab_size:
                raise ValueError(f"{name}: {field}={k} is more than the vocabulary's {self.vocab_size} tokens")
            asked = self.vocab_size if k == -1 else k
            if self.max_logprobs != -1 and asked > self.max_logprobs:
                raise ValueError(f"{name}: {field}={k} asks for {asked} logprobs, more than max_logprobs="
                                 f"{self.max_logprobs} (raise LLM(max_logprobs=...); -1: no limit)")
        return params

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of ``words``: each word (stripped of leading spaces) as it tokenizes at
        the start of a text, and with a leading space where that gives other tokens of the same
        length (vLLM's ``update_from_tokenizer``); ids outside the vocabulary are dropped."""
        sequences = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain) \
                    else (plain,):
                if ids and max(ids) < self.vocab_size and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def params_per_prompt(self, sampling_params, num_prompts: int, label: str = "prompts") -> list[SamplingParams]:
        """``generate``'s ``sampling_params`` (None, one for all, or one per prompt) as one
        checked copy per prompt; ``label``: the caller's name for its prompts (``messages`` for
        ``chat``), used in errors.

        Raises:
            ValueError: a list of another length than the prompts'; as :meth:`params`.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            return [self.params(sampling_params, "sampling_params")] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries but {label} has {num_prompts}: "
                             "give one SamplingParams for all or one per prompt")
        return [self.params(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]


def check_unsupported_request_args(lora_request, priority, num_prompts: int) -> None:
    """vLLM's per-request ``lora_request`` (None, or one None per prompt) and ``priority`` (None,
    or one int per prompt: accepted, and requests are served first come, first served).

    Raises:
        ValueError: a LoRA request (LoRA is not supported); ``priority`` not a list of
            ``num_prompts`` ints.
    """
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(lora is not None for lora in loras):
        raise ValueError(f"lora_request={lora_request!r:.80} is not supported: nanovllm runs no LoRA adapters "
                         f"(use None, or merge the adapter into the weights)")
    if isinstance(lora_request, (list, tuple)) and len(lora_request) != num_prompts:
        raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompt(s)")
    if priority is not None and not (isinstance(priority, (list, tuple)) and len(priority) == num_prompts
                                     and all(is_integer(p) for p in priority)):
        raise ValueError(f"priority must be None or a list of {num_prompts} int(s), one per prompt, "
                         f"got {priority!r:.80}")
