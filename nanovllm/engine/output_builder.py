"""Finished sequences -> vLLM's :class:`RequestOutput`: text, logprob dicts with decoded tokens."""
from nanovllm.sequence import LogprobEntry, Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class OutputBuilder:
    """Builds outputs with one tokenizer; single tokens' texts are decoded once and kept."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, entry: LogprobEntry, k: int, detokenize: bool = True) -> dict[int, Logprob]:
        """``{token: Logprob}``: the entry's own token first, then its top-k (k = -1: all);
        ``decoded_token`` None unless ``detokenize``."""
        ids, logprobs, rank = entry
        width = len(ids) - 1 if k == -1 else k
        text = self._decoded if detokenize else _no_text
        result = {ids[0]: Logprob(logprobs[0], rank, text(ids[0]))}
        for j in range(1, 1 + width):
            result.setdefault(ids[j], Logprob(logprobs[j], j, text(ids[j])))
        return result

    def text(self, seq: Sequence) -> str:
        """The completion's text: the stop-string detokenizer's when there is one; else the
        decoded tokens, less a final eos or stop token id unless ``include_stop_str_in_output``;
        "" with ``detokenize=False``."""
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        params, ids = seq.sampling_params, seq.completion_token_ids
        if not params.detokenize:
            return ""
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) \
                and not params.include_stop_str_in_output:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=params.spaces_between_special_tokens)

    def completion(self, seq: Sequence, index: int) -> CompletionOutput:
        k, detokenize = seq.sampling_params.logprobs, seq.sampling_params.detokenize
        logprobs = None if k is None else [self._logprobs(e, k, detokenize) for e in seq.logprobs]
        return CompletionOutput(index=index, text=self.text(seq), token_ids=seq.completion_token_ids,
                                cumulative_logprob=None if k is None else seq.cumulative_logprob,
                                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def request(self, request_id: str, prompt: str | None, seqs: list[Sequence]) -> RequestOutput:
        """One request's output from its ``n`` sequences (index order); prompt logprobs and the
        cached-token count come from the first."""
        first = seqs[0]
        k = first.num_prompt_logprobs
        prompt_logprobs = None if k is None else [None] + [
            self._logprobs(e, k, first.sampling_params.detokenize) for e in first.prompt_logprobs]
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
            prompt_logprobs=prompt_logprobs,
            outputs=[self.completion(seq, i) for i, seq in enumerate(seqs)],
            finished=all(seq.is_finished for seq in seqs), num_cached_tokens=first.num_cached_tokens,
            metrics=request_metrics(seqs))


def _no_text(token_id: int) -> None:
    return None


def _first(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _last(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    """The timings of a request's ``n`` sequences (see :class:`RequestMetrics`)."""
    arrival = min(seq.arrival_time for seq in seqs)
    scheduled = _first(seq.first_scheduled_time for seq in seqs)
    return RequestMetrics(arrival_time=arrival, last_token_time=_last(seq.last_token_time for seq in seqs),
                          first_scheduled_time=scheduled, first_token_time=_first(seq.first_token_time for seq in seqs),
                          time_in_queue=None if scheduled is None else scheduled - arrival,
                          finished_time=_last(seq.finished_time for seq in seqs))
