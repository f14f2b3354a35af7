"""When a completion ends, by vLLM's (V1) rules: length first (``max_tokens`` or
``max_model_len``), then, once ``min_tokens`` are generated, an eos id or a stop token id, and
stop strings found in the incrementally detokenized text (a stop string ends the request even on
its last token, and may span several tokens)."""
from nanovllm.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """The text of one completion as its tokens arrive, and the stop-string check on it.

    Text grows by decoding a short window of recent tokens (Hugging Face TGI's and vLLM's
    prefix/read offsets), so characters that need several tokens (multi-byte UTF-8) appear when
    complete. The search for stop strings covers only text that is new since the last token,
    plus ``len(stop) - 1`` characters before it (vLLM's ``check_stop_strings``), and starts once
    more than ``min_tokens`` tokens are generated.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        text = self._decode(self.token_ids[self._prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return text[len(prefix):]
        return ""

    def append(self, token_id: int, stop_terminated: bool) -> str | None:
        """Add the newest token; returns the stop string it completed, or None, and cuts
        :attr:`text` before the stop string (after it with ``include_stop_str_in_output``).
        A token that ended the request as eos or stop id is left out of the text unless
        ``include_stop_str_in_output`` (vLLM's rule)."""
        params = self.params
        checked = len(self.text)
        if stop_terminated and not params.include_stop_str_in_output:
            self.token_ids.append(token_id)
            return None
        self.text += self._decode_next(token_id)
        new_chars = len(self.text) - checked
        if len(self.token_ids) <= params.min_tokens or new_chars == 0:
            return None
        for stop in params.stop:
            index = self.text.find(stop, max(0, len(self.text) + 1 - new_chars - len(stop)))
            if index == -1:
                continue
            self.text = self.text[:index + len(stop) if params.include_stop_str_in_output else index]
            return stop
        return None


def reaches_length_limit(seq: Sequence, max_model_len: int, num_new_tokens: int = 0) -> bool:
    """Whether ``seq`` is at ``max_model_len`` or its ``max_tokens`` once ``num_new_tokens`` more
    tokens are appended (the one stop rule known before the tokens are)."""
    max_tokens = seq.sampling_params.max_tokens
    return (len(seq) + num_new_tokens >= max_model_len
            or (max_tokens is not None and seq.num_completion_tokens + num_new_tokens >= max_tokens))


def may_stop_on_token(seq: Sequence, eos_token_ids: set[int]) -> bool:
    """Whether the next sampled token could end ``seq`` by its value, as :func:`check_stop` would
    decide once it is appended: an eos id (unless ``ignore_eos``) or a stop token id once
    ``min_tokens`` are generated, a stop string once more than ``min_tokens`` are."""
    params = seq.sampling_params
    generated = seq.num_completion_tokens + 1
    by_id = generated >= params.min_tokens and bool(params.stop_token_ids or (eos_token_ids and not params.ignore_eos))
    return by_id or (seq.detokenizer is not None and generated > params.min_tokens)


def check_stop(seq: Sequence, token_id: int, eos_token_ids: set[int],
               max_model_len: int) -> tuple[str | None, int | str | None]:
    """``(finish_reason, stop_reason)`` after ``token_id`` was appended to ``seq``:
    ("length", None), ("stop", None) for eos, ("stop", token id) for a stop token id,
    ("stop", string) for a stop string, or (None, None) to go on."""
    params = seq.sampling_params
    reason, stop_reason = None, None
    if reaches_length_limit(seq, max_model_len):
        reason = "length"
    elif seq.num_completion_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            reason = "stop"
        elif token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token_id
    if seq.detokenizer is not None:
        matched = seq.detokenizer.append(token_id, stop_terminated=reason == "stop")
        if matched is not None:
            reason, stop_reason = "stop", matched
    return reason, stop_reason
