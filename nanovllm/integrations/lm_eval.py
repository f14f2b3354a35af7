"""An lm-evaluation-harness backend: model ``"nanovllm"``, registered when this module is imported.

    import nanovllm.integrations.lm_eval  # registers "nanovllm"
    lm_eval.simple_evaluate(model="nanovllm", model_args="pretrained=DIR,enable_cpu_offload=True", tasks=[...])

or from the shell, with lm-eval's own arguments (lm-eval 0.4.13 discovers no out-of-tree model):

    python -m nanovllm.integrations.lm_eval --model nanovllm --model_args pretrained=DIR --tasks ...

``model_args``: lm-eval's vLLM-backend arguments (``pretrained``, ``dtype``, ``revision``,
``tokenizer``, ``trust_remote_code``, ``add_bos_token``, ``prefix_token_id``, ``max_gen_toks``,
``batch_size``, ``max_batch_size`` (= ``max_num_seqs``), ``max_length`` / ``max_model_len``,
``seed``, ``enable_thinking``, ``chat_template_args``, ``think_end_token``, ``truncation_side``)
and every other ``nanovllm.LLM`` option (host tier, sparse policy and budgets, ...), with string
values read as the option's type ("true" -> True, "8" -> 8, "0.5" -> 0.5, "None" -> None; a tuple of
numbers separated by spaces, since commas separate the arguments: "2 1 1 3" -> (2.0, 1.0, 1.0, 3.0)).

Requests run through ``LLM.generate`` in one batch per call (``batch_size="auto"``) or in chunks
of ``batch_size``: log-likelihoods from ``prompt_logprobs=1`` (vLLM's way, natural log),
``generate_until`` greedy or sampled with lm-eval's generation kwargs.
"""
import logging
import sys
import typing
from dataclasses import fields

import lm_eval.models  # noqa: F401  (fills lm-eval's registry with its own models first)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import (Collator, configure_pad_token, handle_stop_sequences, has_bos_prefix,
                                  maybe_truncate, normalize_gen_kwargs, postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

logger = logging.getLogger(__name__)

MODEL_NAME = "nanovllm"


def _parse_string(value: str, annotation):
    """``value`` (a string from ``model_args``) as the Config field's type ``annotation``."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    text = value.strip()
    if text.lower() == "none" and type(None) in kinds:
        return None
    if bool in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if any(typing.get_origin(kind) is tuple for kind in kinds):
        try:
            return tuple(float(word) for word in text.split())
        except ValueError:
            return value
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    return value


def engine_arguments(model_args: dict) -> dict:
    """``model_args`` with the string values of :class:`nanovllm.config.Config` fields read as
    the field's type (ints, floats, bools, None, tuples of space-separated numbers); other values unchanged (lm-eval's own parser
    has typed most already; a dict given to ``simple_evaluate`` may not have)."""
    annotations = {f.name: f.type for f in fields(Config)}
    return {name: _parse_string(value, annotations[name]) if isinstance(value, str) and name in annotations
            else value for name, value in model_args.items()}


def _device(device):
    """lm-eval's ``device`` argument as the engine's. lm-eval passes one on every run ("cuda:0"
    unless ``--device`` says otherwise), so, as its vLLM backend does, it does not decide where a
    CUDA-less machine runs: "cuda" / "cuda:0" give "cuda" where torch sees a CUDA device and
    otherwise "auto" (the CPU), with a warning; "cpu", "auto" and None are the engine's own. A
    ``device`` in ``model_args`` takes precedence.

    Raises:
        ValueError: another device ("cuda:1", "mps", ...), naming the accepted ones.
    """
    if device is None or device in ("auto", "cpu"):
        return device or "auto"
    if device in ("cuda", "cuda:0"):
        if torch.cuda.is_available():
            return "cuda"
        logger.warning("lm-eval's device=%r: torch sees no CUDA device, so the engine runs on the CPU "
                       "(give --device cpu to say so)", device)
        return "auto"
    raise ValueError(f"device={device!r} is not supported by the nanovllm backend: use 'cuda', 'cuda:0' or 'cpu' "
                     f"(choose the GPU with CUDA_VISIBLE_DEVICES)")


class NanoVLLM(TemplateLM):
    """lm-eval's ``LM`` over :class:`nanovllm.LLM` (see the module docstring for the arguments).

    Raises:
        ValueError: a bad engine option (as ``nanovllm.LLM``), a bad ``device``.
    """

    def __init__(self, pretrained: str, dtype: str = "auto", revision: str | None = None,
                 trust_remote_code: bool = False, tokenizer: str | None = None, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, max_gen_toks: int = 256, batch_size="auto",
                 max_batch_size: int | None = None, max_length: int | None = None, max_model_len: int | None = None,
                 seed: int = 1234, device: str | None = None, enable_thinking: bool | None = None,
                 chat_template_args: dict | None = None, think_end_token: str | None = None,
                 truncation_side: str = "left", **engine_kwargs):
        super().__init__()
        if max_length is not None and max_model_len is not None:
            raise ValueError("give max_length or max_model_len, not both")
        self._max_length = max_model_len if max_model_len is not None else max_length
        kwargs = engine_arguments({"dtype": dtype, "revision": revision, "tokenizer": tokenizer,
                                   "trust_remote_code": trust_remote_code, "seed": seed,
                                   "max_model_len": None if self._max_length is None else int(self._max_length),
                                   "device": _device(device), **engine_kwargs})
        if max_batch_size is not None and "max_num_seqs" not in kwargs:
            kwargs["max_num_seqs"] = int(max_batch_size)
        self.llm = LLM(pretrained, **kwargs)
        self.batch_size = "auto" if isinstance(batch_size, str) and "auto" in batch_size else int(batch_size)
        self.add_bos_token, self.custom_prefix_token_id = add_bos_token, prefix_token_id
        self.tokenizer = configure_pad_token(self.llm.get_tokenizer(), model_config=self.llm.config.hf_config)
        self.chat_template_args = dict(chat_template_args or {})
        self.enable_thinking = self.chat_template_args.pop("enable_thinking", enable_thinking)
        if self.enable_thinking and think_end_token is None:
            raise ValueError("enable_thinking=True needs think_end_token (the marker that ends the thinking)")
        self.think_end_token, self.truncation_side = think_end_token, truncation_side
        self._max_gen_toks = int(max_gen_toks)

    # ---- what lm-eval reads --------------------------------------------------------------
    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self):
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return int(self._max_length) if self._max_length else self.llm.llm_engine.model_config.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        extra = dict(self.chat_template_args)
        if self.enable_thinking is not None:
            extra["enable_thinking"] = self.enable_thinking
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt, **extra)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of ``string`` as lm-eval's ``hf`` backend makes them (the tokenizer's special
        tokens unless ``add_bos_token`` says otherwise; none when the text starts with BOS)."""
        if not string:
            return []
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        else:
            special = {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}
            if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- running requests ----------------------------------------------------------------
    def _batches(self, items: list) -> list[list]:
        size = len(items) if self.batch_size == "auto" else max(1, self.batch_size)
        return [items[i:i + size] for i in range(0, len(items), size)] if items else []

    def _generate(self, token_ids: list[list[int]], params) -> list:
        return self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probabilities, whether it is the greedy continuation)``
        per ``(cache key, context ids, continuation ids)``; context left-truncated to fit
        ``max_length - 1`` tokens (one generated token is the engine's minimum)."""
        limit = self.max_length - 1
        params = SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        ordered = [request for batch in order.get_batched(n=0, batch_fn=None) for request in batch]
        results = []
        for batch in self._batches(ordered):
            inputs, starts = [], []
            for _, context, continuation in batch:
                whole = (context + continuation)[-limit:]
                inputs.append(whole)
                starts.append(len(whole) - len(continuation))
            for (key, _, _), ids, start, out in zip(batch, inputs, starts, self._generate(inputs, params)):
                entries = out.prompt_logprobs[start:]
                answer = (sum(entry[token].logprob for token, entry in zip(ids[start:], entries)),
                          all(entry[token].rank == 1 for token, entry in zip(ids[start:], entries)))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length - 2`` tokens (lm-eval's
        rolling windows, the first predicted from the prefix token; the ``vllm`` backend's length,
        where ``hf`` takes ``max_length``)."""
        windows, counts = [], []
        for (text,) in (req.args for req in requests):
            rolling = [(None,) + make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 2, context_len=1)]
            windows += rolling
            counts.append(len(rolling))
        scores = self._loglikelihood_tokens(windows) if windows else []
        totals, offset = [], 0
        for req, n in zip(requests, counts):
            totals.append(sum(score for score, _ in scores[offset:offset + n]))
            offset += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each ``(context, gen_kwargs)`` continued until a stop string of ``until`` (or eos, or
        ``max_gen_toks``), the context truncated on ``truncation_side`` to leave room for them."""
        eos = self.tokenizer.decode(self.eot_token_id) or getattr(self.tokenizer, "eos_token", None)
        prompts, params, untils = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            sp, until, max_gen_toks = generation_params(gen_kwargs, eos, self.max_gen_toks,
                                                        stop_at_eos_only=bool(self.think_end_token))
            ids, sp.max_tokens = maybe_truncate(self.tok_encode(context), max_gen_toks=max_gen_toks,
                                                max_model_len=self.max_length, side=self.truncation_side, verbose=True)
            prompts.append(ids)
            params.append(sp)
            untils.append(until)
        texts = []
        for batch in self._batches(list(range(len(prompts)))):
            outs = self._generate([prompts[i] for i in batch], [params[i] for i in batch])
            texts += [out.outputs[0].text for out in outs]
        results = []
        for req, text, until in zip(requests, texts, untils):
            text = postprocess_generated_text(text, until, self.think_end_token)
            results.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results


def generation_params(gen_kwargs: dict, eos: str, default_max_gen_toks: int,
                      stop_at_eos_only: bool = False) -> tuple[SamplingParams, list[str], int]:
    """A ``generate_until`` request's SamplingParams from lm-eval's generation kwargs, with its
    stop strings (``until`` and ``eos``) and token limit. Greedy unless ``do_sample`` is true, as
    lm-eval's ``hf`` backend decodes (``normalize_gen_kwargs`` leaves ``temperature`` unset when
    a task gives neither, and SamplingParams' default would sample at 1.0). Other kwargs are
    SamplingParams fields. ``stop_at_eos_only``: the engine stops at ``eos`` alone (a thinking
    model's ``until`` applies after its thinking, in post-processing)."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks=default_max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = int(kwargs.pop("max_gen_toks", default_max_gen_toks))
    if not kwargs.pop("do_sample", False):
        kwargs["temperature"] = 0.0
    kwargs = {"skip_special_tokens": False, "spaces_between_special_tokens": False, **kwargs}
    stop = [s for s in until if s == eos] if stop_at_eos_only else until
    return SamplingParams(max_tokens=max_gen_toks, stop=stop, **kwargs), until, max_gen_toks


model_registry.register(MODEL_NAME, target=f"{__spec__.name if __spec__ else __name__}:NanoVLLM")


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval ...``) with the ``nanovllm`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
