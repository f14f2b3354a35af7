"""The engine loop: requests in, scheduler and model runner per step, finished outputs out."""
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config, check_engine_args
from nanovllm.parallel import data_parallel, ranks
from nanovllm.engine.step_loop import StepLoop
from nanovllm.parallel.data_parallel import ReplicaPool, replica_config, torchrun_replicas
from nanovllm.engine.engine_stats import EngineStats
from nanovllm.engine.prompts import (Prompt, as_list, check_chat_args, parse_conversations, parse_prompt, parse_prompts,
                                     render_chat)
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_builder import OutputBuilder
from nanovllm.engine.request_checks import RequestChecker, check_unsupported_request_args
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sequence import Sequence
from nanovllm.engine.stopping import IncrementalDetokenizer
from nanovllm.engine.tokenizer import default_sampling_fields, eos_token_ids, load_tokenizer
from nanovllm.parallel.process_group import check_same_calls
from nanovllm.hub import resolve_model
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.vllm_compat import ModelConfig

logger = logging.getLogger(__name__)


class LLMEngine(EngineStats):
    """Offline inference engine (see :class:`nanovllm.LLM` for the arguments).

    ``model`` is a local directory or a Hugging Face Hub id (downloaded at ``revision`` into
    ``download_dir``, see :func:`nanovllm.hub.resolve_model`); so is ``tokenizer``, at
    ``tokenizer_revision`` (default ``revision``). vLLM's other arguments are accepted at values
    that are a no-op here (``nanovllm.vllm_compat``); ``model_config`` is the read-only view
    vLLM's ``llm_engine.model_config`` gives.

    With ``tensor_parallel_size > 1`` in a plain process, this process is rank 0 and spawns
    the other ranks on this host. Under torchrun every rank builds its own engine with the same
    arguments and must make the same calls; ``generate`` returns the same outputs on every rank.
    With ``data_parallel_size > 1`` this engine is one of the replicas that share every
    ``generate`` (``nanovllm.parallel.data_parallel``): replica 0, which starts the others on this
    host, or under torchrun the replica of this rank.
    """

    def __init__(self, model: str, revision: str | None = None, download_dir: str | None = None,
                 tokenizer_revision: str | None = None, **kwargs):
        generation_config = kwargs.get("generation_config", "auto")
        kwargs = check_engine_args(kwargs)
        model_id, model = model, resolve_model(model, revision, download_dir)
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is None and tokenizer_revision not in (None, revision):
            tokenizer = model_id
        if tokenizer is not None:
            kwargs["tokenizer"] = resolve_model(tokenizer, revision if tokenizer_revision is None else tokenizer_revision,
                                                download_dir, what="tokenizer")
        config = Config(model, **kwargs)
        tokenizer = load_tokenizer(config)
        config.eos_token_ids = eos_token_ids(model, tokenizer, config.hf_config)
        self._start(config, tokenizer, spawned_replica=None)
        self._default_sampling = default_sampling_fields(model) if generation_config == "auto" else {}

    @classmethod
    def _spawned_replica(cls, config: Config, replica: int) -> "LLMEngine":
        """Replica ``replica`` >= 1 of a spawned data-parallel engine (in its own process)."""
        engine = cls.__new__(cls)
        engine._start(config, load_tokenizer(config), replica)
        return engine

    def _start(self, config: Config, tokenizer, spawned_replica: int | None):
        """Build this process's replica: its runner (and tensor-parallel ranks) and scheduler;
        as replica 0 of a spawned data-parallel engine, also start the other replicas."""
        self.config, self.tokenizer = config, tokenizer
        self._default_sampling: dict = {}
        self._outputs = OutputBuilder(tokenizer)
        self._request_ids = itertools.count()  # one id per prompt, as vLLM's request counter
        self._workers, self._generators, self._replicas = [], {}, None
        launch = config.launch
        if launch.torchrun:
            self.rank = launch.rank
            self._replicas = torchrun_replicas(config, launch)
            self.model_runner = ModelRunner(replica_config(config, launch.replica), launch.tp_rank,
                                            local_rank=launch.local_rank)
        else:
            self.rank, replica = 0, spawned_replica or 0
            if spawned_replica is None and config.data_parallel_size > 1:
                self._replicas = ReplicaPool(config, _replica_main)
            try:
                self.model_runner = ranks.spawn_ranks(ModelRunner, replica_config(config, replica),
                                                      replica * config.tensor_parallel_size, self._workers)
            except BaseException:
                if self._replicas is not None:
                    self._replicas.close()
                raise
        self.scheduler = self._make_scheduler()
        self._steps = StepLoop(self.scheduler, self.model_runner, self._generators, config.async_scheduling)
        self._finalizer = weakref.finalize(self, ranks.shutdown, self.model_runner, self._workers, self._replicas)
        capacity = sum(self.model_runner.tier_sizes) * config.kvcache_block_size
        try:
            self._kv_capacity = capacity if self._replicas is None else min(self._replicas.join(capacity))
        except BaseException:
            self._finalizer()
            raise
        self._checks = RequestChecker(tokenizer, config.hf_config.vocab_size, config.max_model_len, self._kv_capacity,
                                     config.max_logprobs, config.eos_token_ids)
        self._model_config = ModelConfig(
            model=config.model, tokenizer=config.tokenizer or config.model, max_model_len=config.max_model_len,
            dtype=config.dtype, seed=config.seed, hf_config=config.hf_config, trust_remote_code=config.trust_remote_code,
            max_logprobs=config.max_logprobs)

    def _make_scheduler(self) -> Scheduler:
        return Scheduler(self.config, self.model_runner.cache.block_manager(self.model_runner.tier_sizes))

    # ---- requests ----------------------------------------------------------------------
    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model settings, read-only (vLLM's ``ModelConfig`` names: ``max_model_len``, ``model``,
        ``tokenizer``, ``dtype``, ``seed``, ``hf_config``)."""
        return self._model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(prompts)`` uses without ``sampling_params`` (vLLM's rule): SamplingParams'
        defaults, with the sampling fields the model's ``generation_config.json`` sets
        (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
        ``max_new_tokens`` as ``max_tokens``), unless built with ``generation_config="vllm"``."""
        return SamplingParams(**self._default_sampling)

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        """Queue one request (one completion: ``n`` must be 1) in any prompt form ``generate``
        takes; returns its sequence id. :meth:`step` returns it when it finishes.

        Raises:
            ValueError: empty prompt, prompt longer than ``max_model_len``, token id outside the
                vocabulary, a bad SamplingParams field, ``n > 1``. RuntimeError: the prompt cannot
                fit in the KV cache; ``data_parallel_size > 1`` (see :meth:`_check_one_replica`).
        """
        self._check_open()
        self._check_one_replica("add_request")
        self._check_same_calls(prompt, sampling_params)
        params = self._checks.params(sampling_params, "sampling_params")
        if params.n != 1:
            raise ValueError(f"add_request queues one completion (n=1), got n={params.n}; generate() and "
                             f"chat() take n > 1")
        return self._add(self._checks.token_ids(parse_prompt(prompt)), params)

    def _check_same_calls(self, prompts, sampling_params):
        """torchrun: the ranks' arguments must agree (checked before anything can raise on one
        rank only, which would leave the others waiting in a collective): over every rank of
        every replica with data parallelism, else over the tensor-parallel ranks."""
        if not self.config.launch.torchrun:
            return
        payload = repr((_as_lists(prompts), sampling_params)).encode()
        if self._replicas is not None:
            self._replicas.check_same_calls(payload)
        elif self.config.tensor_parallel_size > 1:
            check_same_calls(payload, self.model_runner.device)

    def _check_one_replica(self, method: str):
        """``add_request`` and ``step`` drive one scheduler; with data parallelism the requests
        are split across replicas per ``generate`` call, so they are refused rather than run on
        one replica only."""
        if self._replicas is not None:
            raise RuntimeError(f"{method}() drives one replica's scheduler and is not supported with "
                               f"data_parallel_size={self.config.data_parallel_size}; use generate() or "
                               f"chat(), which split the requests across the replicas")

    def _check_open(self):
        if not self._finalizer.alive:
            raise RuntimeError("this engine has been shut down; create a new LLM")

    def _check_idle(self):
        """generate() and chat() return their own requests' outputs only; requests queued with
        add_request() are returned by step(). Rather than run those to completion unseen, the
        two ways are not mixed."""
        if not self.scheduler.is_finished():
            queued = len(self.scheduler.waiting) + len(self.scheduler.running)
            raise RuntimeError(f"generate() and chat() need an idle engine, but {queued} sequence(s) queued "
                               f"with add_request() are unfinished; call step() until is_finished() (step() returns "
                               f"them as they finish) before calling generate() or chat()")

    def _add(self, ids: list[int], params: SamplingParams) -> int:
        seq = Sequence(ids, params, self.config.kvcache_block_size)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params)
        if params.seed is not None:
            self._generators[seq.seq_id] = torch.Generator(self.model_runner.device).manual_seed(params.seed)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[Sequence], int]:
        """Run one scheduled step. Returns the sequences finished in it and the number of
        tokens processed (positive for a prefill step, negative for decode, as nano-vLLM).
        With ``async_scheduling`` a decode step is launched and its sequences are returned by the
        next call, when they are found finished (``nanovllm.engine.step_loop``); call
        :meth:`step` until :meth:`is_finished`.

        Raises:
            RuntimeError: a tensor-parallel rank died; ``data_parallel_size > 1``.
        """
        self._check_open()
        self._check_one_replica("step")
        return self._step()

    def _step(self) -> tuple[list[Sequence], int]:
        ranks.check_workers(self._workers)
        return self._steps.step()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    # ---- batch API ---------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, lora_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate completions for ``prompts``: one prompt or a list, each a string, a list of
        token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (vLLM's forms).
        ``sampling_params``: one for all prompts, one per prompt, or None
        (:meth:`get_default_sampling_params`). ``lora_request``: None (or a list of Nones);
        ``priority``: None or one int per prompt, accepted and not used (requests are served first
        come, first served, as vLLM's default "fcfs" policy does).

        Returns one :class:`nanovllm.outputs.RequestOutput` per prompt, in input order, with
        its ``n`` completions; ``out["text"]`` / ``out["token_ids"]`` / ``out["finish_reason"]``
        read the first completion (nano-vLLM's dict style).

        Raises:
            ValueError: ``prompts`` or a prompt of a wrong form, empty, longer than
                ``max_model_len``, with ids outside the vocabulary or text that is not valid
                Unicode; a bad SamplingParams; a LoRA request; ``priority`` not one int per
                prompt. Everything is checked before anything is queued, so the engine keeps
                serving. ``use_tqdm`` neither a bool nor a callable (a progress bar's class or
                factory, called as ``tqdm``).
            RuntimeError: a prompt that cannot fit in the KV cache; requests queued with
                ``add_request`` are still unfinished.
        """
        self._check_open()
        self._check_same_calls(prompts, sampling_params)
        prompts = parse_prompts(prompts)
        check_unsupported_request_args(lora_request, priority, len(prompts))
        return self._generate(prompts, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` message dicts;
        ``content`` a string or OpenAI's text parts ``[{"type": "text", "text": ...}]``) or a list
        of conversations, through the tokenizer's chat template (or ``chat_template``), with vLLM's
        arguments in vLLM's order. As vLLM, the templated text is tokenized without adding special
        tokens (the template has them). ``chat_template_content_format``: "auto" / "string" (text
        parts joined by newlines) or "openai" (parts passed to the template as they are).
        ``continue_final_message``: the reply continues the last message (an assistant prefix)
        instead of starting a new one; needs ``add_generation_prompt=False``. ``tools``: passed to
        the template. ``chat_template_kwargs``: extra template variables (e.g.
        ``{"enable_thinking": False}`` for Qwen3). Returns one RequestOutput per conversation,
        ``prompt`` the templated text.

        Raises:
            ValueError: ``messages`` is not a conversation or a list of them (a message without a
                string ``role``, content that is neither a string nor text parts, text that is not
                valid Unicode, naming the conversation and message); the tokenizer has no chat
                template and none is given; ``add_generation_prompt`` / ``continue_final_message``
                not bools, or both True; ``chat_template_kwargs`` not a dict with string keys or
                naming an argument this method sets; a LoRA request or multi-modal kwargs; as
                :meth:`generate`.
        """
        self._check_open()
        self._check_same_calls(messages, (sampling_params, chat_template, add_generation_prompt, chat_template_kwargs,
                                          continue_final_message, tools, chat_template_content_format))
        extra = check_chat_args(add_generation_prompt, continue_final_message, chat_template_content_format,
                                chat_template_kwargs, mm_processor_kwargs)
        conversations = parse_conversations(messages, keep_parts=chat_template_content_format == "openai")
        check_unsupported_request_args(lora_request, None, len(conversations))
        prompts = []
        for conversation in conversations:
            text = render_chat(self.tokenizer, conversation, chat_template, add_generation_prompt,
                               continue_final_message, tools, extra)
            prompts.append(Prompt(text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._generate(prompts, sampling_params, use_tqdm, label="messages")

    def _generate(self, prompts: list[Prompt], sampling_params, use_tqdm: bool | Callable[..., tqdm],
                  label: str = "prompts") -> list[RequestOutput]:
        """Validate everything, then run the requests here or split them across the replicas.
        ``label``: the caller's argument, named in errors (``prompts[i]``, ``messages[i]``)."""
        self._check_idle()
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm must be True, False or a callable that makes a progress bar (as tqdm, "
                             f"vLLM's form), got {use_tqdm!r}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._checks.params_per_prompt(sampling_params, len(prompts), label)
        prompts = [Prompt(p.text, self._checks.token_ids(p, f"{label}[{i}]", sp.truncate_prompt_tokens))
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        if self._replicas is None:
            return self._run_requests(prompts, params, use_tqdm)
        costs = [data_parallel.request_cost(len(p.token_ids), sp, self.config.max_model_len)
                 for p, sp in zip(prompts, params)]
        shares = data_parallel.split_by_cost(costs, self.config.data_parallel_size)
        results = self._replicas.run([([prompts[i] for i in share], [params[i] for i in share]) for share in shares],
                                     lambda share: self._run_requests(*share, use_tqdm))
        return data_parallel.number_requests(data_parallel.in_input_order(shares, results))

    def _run_requests(self, prompts: list[Prompt], params: list[SamplingParams],
                      use_tqdm: bool | Callable[..., tqdm] = False) -> list[RequestOutput]:
        """Run validated requests (``prompts`` tokenized) on this replica to completion."""
        groups, seq_ids = [], []
        try:
            for ids, sp in zip((p.token_ids for p in prompts), params):
                groups.append([self._add(ids, child) for child in _completions(sp)])
                seq_ids += groups[-1]
            return self._run_until_done(prompts, groups, use_tqdm)
        except BaseException:
            for seq_id in seq_ids:
                self._generators.pop(seq_id, None)
            self.scheduler.abort(set(seq_ids))
            self._steps.drop_in_flight()
            raise

    def _run_until_done(self, prompts: list[Prompt], groups: list[list[int]],
                        use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step until every sequence of ``groups`` (a request's sequence ids each) finishes. A
        request's output is built (detokenized) as soon as its last sequence finishes, while the
        device runs the steps in flight, rather than all at the end."""
        group_of = {seq_id: i for i, group in enumerate(groups) for seq_id in group}
        request_ids = [str(next(self._request_ids)) for _ in groups]
        finished: dict[int, Sequence] = {}
        outputs: list[RequestOutput | None] = [None] * len(groups)
        bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(groups), desc="Processed prompts",
                                                         dynamic_ncols=True, disable=not use_tqdm or self.rank > 0)
        prefill_tps = decode_tps = 0.0
        while len(finished) < len(group_of):
            t = time.perf_counter()
            done, num_tokens = self._step()
            rate = abs(num_tokens) / max(time.perf_counter() - t, 1e-9)
            prefill_tps, decode_tps = (rate, decode_tps) if num_tokens > 0 else (prefill_tps, rate)
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            for seq in done:
                finished[seq.seq_id] = seq
                r = group_of[seq.seq_id]
                if all(seq_id in finished for seq_id in groups[r]):
                    outputs[r] = self._outputs.request(request_ids[r], prompts[r].text,
                                                       [finished[seq_id] for seq_id in groups[r]])
                    bar.update(1)
        bar.close()
        return outputs

    def shutdown(self):
        """Stop the workers and free graphs and KV memory (also run when the engine is garbage
        collected and at interpreter exit); the engine cannot be used after."""
        self._finalizer()
        for name in ("_steps", "model_runner"):  # the step loop holds the runner (and a step in flight)
            self.__dict__.pop(name, None)


def _as_lists(prompts):
    """``prompts`` with every array or tensor in it (one level down) as a list."""
    if isinstance(prompts, (list, tuple)):
        return [as_list(p) for p in prompts]
    return as_list(prompts)


def _completions(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` one-completion params of a request (vLLM's rule: completion i's seed is
    seed + i; prompt logprobs are computed once, by completion 0)."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(params.n)]


def _replica_main(conn, config: Config, replica: int):
    """A spawned data-parallel replica's process: build its engine, report its KV capacity (or
    why it failed), then run the calls replica 0 sends (``data_parallel.ReplicaPool``)."""
    try:
        engine = LLMEngine._spawned_replica(config, replica)
    except Exception:
        data_parallel.report_start_failure(conn)
        return
    try:
        data_parallel.serve(conn, engine._kv_capacity, {
            "generate": engine._run_requests, "get_kv_cache_stats": engine.get_kv_cache_stats,
            "get_sparse_stats": engine.get_sparse_stats, "reset_sparse_stats": engine.reset_sparse_stats,
            "reset_prefix_cache": engine.reset_prefix_cache})
    finally:
        engine.shutdown()


