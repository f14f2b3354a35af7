"""The engine loop: requests in, scheduler and model runner per step, finished outputs out."""
import logging
import time
import weakref
from multiprocessing import get_context

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_worker import (check_same_calls, new_shm_name, rendezvous_store, torchrun_rank,
                                       wait_for_workers)
from nanovllm.kvcache.block_manager import BlockManager
from nanovllm.sampling_params import SamplingParams, is_integer

logger = logging.getLogger(__name__)


def eos_token_ids(model: str, tokenizer) -> list[int]:
    """End-of-sequence ids from ``generation_config.json`` (int or list) and the tokenizer."""
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLMEngine:
    """Offline inference engine (see :class:`nanovllm.LLM` for the arguments).

    With ``tensor_parallel_size > 1`` in a plain process, this process is rank 0 and spawns
    the other ranks on this host. Under torchrun every rank builds its own engine with the same
    arguments and must make the same calls; ``generate`` returns the same outputs on every rank.
    """

    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        config.eos_token_ids = eos_token_ids(model, self.tokenizer)
        self._workers, self._generators = [], {}
        launch = torchrun_rank()
        if launch is not None:
            self.rank = launch.rank
            self.model_runner = ModelRunner(config, launch.rank, local_rank=launch.local_rank)
        else:
            self.rank = 0
            self.model_runner = self._spawn_ranks(config)
        self.scheduler = self._make_scheduler()
        self.vocab_size = config.hf_config.vocab_size
        self._finalizer = weakref.finalize(self, _shutdown, self.model_runner, self._workers)

    def _spawn_ranks(self, config: Config) -> ModelRunner:
        """Start ranks 1..N-1 as processes on this host; return rank 0's runner."""
        channel, events, store = None, [], None
        if config.tensor_parallel_size > 1:
            channel, store = new_shm_name(), rendezvous_store(config.tensor_parallel_size)
            ctx = get_context("spawn")
            for rank in range(1, config.tensor_parallel_size):
                event = ctx.Event()
                proc = ctx.Process(target=ModelRunner, args=(config, rank, channel, event, store.port))
                proc.start()
                self._workers.append(proc)
                events.append(event)
        try:
            if store is not None:
                wait_for_workers(store, self._workers)
            return ModelRunner(config, 0, channel, events, store=store)
        except BaseException:
            for proc in self._workers:
                proc.terminate()
                proc.join()
            raise

    def _check_workers(self):
        """A spawned rank that died would leave the others waiting in a collective forever."""
        for rank, proc in enumerate(self._workers, 1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                   f"{proc.exitcode}; shut this engine down and create a new LLM")

    def _make_scheduler(self) -> Scheduler:
        sizes = self.model_runner.tier_sizes
        return Scheduler(self.config, BlockManager(sizes.gpu_blocks, self.config.kvcache_block_size, sizes.host_blocks))

    # ---- requests ----------------------------------------------------------------------
    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif hasattr(prompt, "tolist"):  # numpy array or tensor
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        self._validate(ids)
        return ids

    def _validate(self, ids: list[int]):
        cfg = self.config
        if not ids:
            raise ValueError("prompt is empty (0 tokens); at least 1 token is required")
        if len(ids) > cfg.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={cfg.max_model_len}")
        not_int = [t for t in ids if not is_integer(t)]
        if not_int:
            raise ValueError(f"token id {not_int[0]!r} is not an integer")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        capacity = sum(self.model_runner.tier_sizes) * cfg.kvcache_block_size
        if len(ids) > capacity:
            raise RuntimeError(f"prompt has {len(ids)} tokens but the KV cache holds {capacity}")

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id.

        Raises:
            ValueError: empty prompt, prompt longer than ``max_model_len``, token id outside the
                vocabulary. RuntimeError: the prompt cannot fit in the KV cache.
        """
        self._check_open()
        self._check_same_calls(prompt, sampling_params)
        _check_params(0, sampling_params)
        return self._add(self._token_ids(prompt), sampling_params)

    def _check_same_calls(self, prompts, sampling_params):
        """torchrun: the ranks' arguments must agree (checked before anything can raise on one
        rank only, which would leave the others waiting in a collective)."""
        if torchrun_rank() is not None and self.config.tensor_parallel_size > 1:
            check_same_calls(repr((_as_lists(prompts), sampling_params)).encode(), self.model_runner.device)

    def _check_open(self):
        if not self._finalizer.alive:
            raise RuntimeError("this engine has been shut down; create a new LLM")

    def _add(self, ids: list[int], sampling_params: SamplingParams) -> int:
        gen = None
        if sampling_params.seed is not None:
            gen = torch.Generator(self.model_runner.device).manual_seed(sampling_params.seed)
        seq = Sequence(ids, sampling_params, self.config.kvcache_block_size)
        if gen is not None:
            self._generators[seq.seq_id] = gen
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[Sequence], int]:
        """Run one scheduled step. Returns the sequences finished in it and the number of
        tokens processed (positive for a prefill step, negative for decode, as nano-vLLM)."""
        self._check_open()
        self._check_workers()
        if self.scheduler.is_finished():
            return [], 0
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            raise RuntimeError("the scheduler could not schedule any sequence (KV cache too small)")
        num_tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)
        tokens = self.model_runner.run(seqs, is_prefill, self._generators, self.scheduler.take_spills())
        finished = self.scheduler.postprocess(seqs, tokens)
        for seq in finished:
            self._generators.pop(seq.seq_id, None)
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    # ---- batch API ---------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate completions for ``prompts`` (strings or token-id lists).

        Returns ``[{"text", "token_ids", "finish_reason"}]`` in input order. Every prompt is
        validated before any is queued, so a bad prompt raises (ValueError / RuntimeError naming
        the value and the limit) and leaves the engine serving what it already had.
        """
        self._check_open()
        self._check_same_calls(prompts, sampling_params)
        if isinstance(prompts, str) or (prompts and is_integer(prompts[0])):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        for i, sp in enumerate(sampling_params):
            _check_params(i, sp)
        token_ids = [self._token_ids(p) for p in prompts]
        seq_ids = []
        try:
            for ids, sp in zip(token_ids, sampling_params):
                seq_ids.append(self._add(ids, sp))
            results = self._run_until_done(set(seq_ids), use_tqdm)
        except BaseException:
            for seq_id in seq_ids:
                self._generators.pop(seq_id, None)
            self.scheduler.abort(set(seq_ids))
            raise
        return [results[i] for i in seq_ids]

    def _run_until_done(self, pending: set[int], use_tqdm: bool) -> dict[int, dict]:
        results = {}
        bar = tqdm(total=len(pending), desc="Generating", dynamic_ncols=True,
                   disable=not use_tqdm or self.rank > 0)
        prefill_tps = decode_tps = 0.0
        while pending - results.keys():
            t = time.perf_counter()
            finished, num_tokens = self.step()
            rate = abs(num_tokens) / max(time.perf_counter() - t, 1e-9)
            prefill_tps, decode_tps = (rate, decode_tps) if num_tokens > 0 else (prefill_tps, rate)
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            for seq in finished:
                results[seq.seq_id] = {
                    "text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
                    "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason,
                    "num_cached_tokens": seq.num_cached_tokens}
                bar.update(1)
        bar.close()
        return results

    # ---- statistics --------------------------------------------------------------------
    def get_kv_cache_stats(self) -> dict:
        """The KV cache's tiers as plain ints::

            {"gpu_blocks", "gpu_blocks_used", "host_blocks", "host_blocks_used",
             "spilled_blocks", "loaded_blocks", "prefix_cache_hit_tokens", "preemptions"}

        ``*_used``: blocks held by live sequences (free blocks that still hold a cached prefix
        are not used). ``spilled_blocks``: blocks moved from the GPU tier to the host tier since
        the engine started; ``loaded_blocks``: host-to-GPU reads since then, in blocks of every
        layer (keys and values); ``prefix_cache_hit_tokens``: prompt tokens found in the prefix
        cache (either tier); ``preemptions``: sequences preempted (recomputed later) because
        both tiers were full. Blocks are ``kvcache_block_size`` tokens. With
        ``tensor_parallel_size > 1``, ``loaded_blocks`` is rank 0's (every rank reads its shard).
        """
        self._check_open()
        return {**self.scheduler.block_manager.usage(), "loaded_blocks": self.model_runner.cache.loaded_blocks(),
                "preemptions": self.scheduler.num_preemptions}

    def get_sparse_stats(self) -> dict:
        """Densities of the sparse policy since the engine started or the last
        :meth:`reset_sparse_stats`, as plain Python numbers::

            {"policy": "XATTN_BSA",
             "prefill": {"density", "comm_density", "kept_blocks", "visible_blocks",
                         "loaded_host_blocks", "available_host_blocks",
                         "per_layer": [{"layer", "density", "comm_density"}, ...]},
             "decode": {"comm_density", "loaded_host_blocks", "available_host_blocks",
                        "per_layer": [{"layer", "comm_density"}, ...]}}

        ``density``: kept / causally visible sparse blocks (``sparse_block_size`` tokens) over
        heads and query blocks; 1.0 for policies whose prefill is dense (FULL, QUEST).
        ``comm_density``: host-tier blocks read (keys and values) / host-tier blocks the
        attention could read, per layer (None where the batch had no host blocks).
        Reading syncs with the device once per layer; counting never does. With
        ``tensor_parallel_size > 1`` these are rank 0's counts (its share of the heads).
        """
        self._check_open()
        cache = self.model_runner.cache
        return {"policy": self.config.sparse_policy.value, **cache.stats.to_dict(cache.policy.dense_prefill)}

    def reset_sparse_stats(self) -> None:
        """Zero the counts behind :meth:`get_sparse_stats`."""
        self._check_open()
        self.model_runner.cache.stats.reset()

    def shutdown(self):
        """Stop the workers and free graphs and KV memory (also run when the engine is garbage
        collected and at interpreter exit); the engine cannot be used after."""
        self._finalizer()
        self.__dict__.pop("model_runner", None)


def _as_lists(prompts):
    """Arrays and tensors as lists, whose repr shows every id (an array's repr elides)."""
    if hasattr(prompts, "tolist"):
        return prompts.tolist()
    if isinstance(prompts, (list, tuple)):
        return [p.tolist() if hasattr(p, "tolist") else p for p in prompts]
    return prompts


def _check_params(index: int, params) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}")


def _shutdown(model_runner: ModelRunner, workers: list):
    if all(proc.is_alive() for proc in workers):
        model_runner.call("exit")
    else:  # a dead worker's event would block the send: stop the others instead
        for proc in workers:
            proc.terminate()
        model_runner.exit()
    for proc in workers:
        proc.join()
