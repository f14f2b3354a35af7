"""Runs the model for a scheduled batch: owns the model, the KV cache and the CUDA graphs.

One ModelRunner per tensor-parallel rank; every public method that touches the model runs on
all ranks with the same arguments. With spawned workers, rank 0 lives in the user's process and
drives the others through a :class:`RankChannel`; under torchrun each rank's engine makes the
same calls itself and rank 0's sampled tokens are broadcast (``nanovllm.parallel``).

A step: ``cache.begin_step(moves)`` -> ``cache.prepare`` -> model -> ``cache.finish_step`` ->
sample (rank 0). A step returns its results on the device (:class:`SampledStep`); the engine
reads them at once or, with async scheduling, one step later (``step_loop``).
"""
import gc
import logging

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.kvcache import sizing
from nanovllm.engine.cuda_graphs import DecodeGraphs, captured_batch_sizes
from nanovllm.engine.sampling_batch import LogitRows, SampledStep, StepSampler
from nanovllm.sequence import Sequence
from nanovllm.parallel.channel import RankChannel
from nanovllm.parallel.process_group import destroy_process_group, init_process_group
from nanovllm.parallel.ranks import join
from nanovllm.kvcache.cache import KVCache
from nanovllm.kvcache.eviction import BlockMove
from nanovllm.kvcache.key_offset import calibration_token_ids
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler
from nanovllm.models import get_model_class
from nanovllm.kvcache.context import Context, get_context, reset_context, set_context
from nanovllm.models.loader import load_model
from nanovllm.utils.tensors import to_device

logger = logging.getLogger(__name__)


class ModelRunner:
    """Args: config, rank, the channel to spawned workers (None when TP is 1 or under
    torchrun), the rendezvous of a spawned engine (rank 0: its TCP ``store``; workers: the
    store's ``port``) and the CUDA device index on this host (``local_rank``, default ``rank``)."""

    def __init__(self, config: Config, rank: int, channel_name: str | None = None, events=None,
                 port: int = 0, local_rank: int | None = None, store=None):
        self.config = config
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.ranks_on_host = config.launch.local_world_size
        device_index = rank if local_rank is None else local_rank
        self.device = torch.device("cuda", device_index) if config.device == "cuda" else torch.device("cpu")
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            if channel_name and rank > 0:
                store = join(port, rank, self.world_size)
            init_process_group(config.device, rank, self.world_size, store, config.launch)
        self.channel = self.cache = self.graphs = None
        try:
            self.model = self._build_model()
            self.sampler = Sampler()
            self.generator = torch.Generator(self.device).manual_seed(config.seed)
            self.step_sampler = StepSampler(self.sampler, self.generator, config.eos_token_ids, rank,
                                            broadcast=self.world_size > 1 and channel_name is None)
            cuda = self.device.type == "cuda"
            self.captures_graphs = cuda and not config.enforce_eager
            layers = [m for m in self.model.modules() if isinstance(m, Attention)]
            self.cache = KVCache(config, layers, self.device, captured_batch_sizes(config.max_num_seqs) if cuda else None,
                                 self.captures_graphs)
            self.channel = RankChannel(channel_name, rank, events) if channel_name else None
            self.setup()
        except BaseException:  # leave nothing behind, so that another engine can start
            self._release_ranks()
            raise
        if self.channel is not None and rank > 0:
            self._worker_loop()

    # ---- setup -------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        cfg = self.config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(cfg.dtype)
        try:
            with torch.device(self.device):
                model = get_model_class(cfg.hf_config)(cfg.hf_config, cfg.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(model, cfg.model)
        return model.eval()

    def setup(self):
        """Calibrate an fp8 cache's key offsets, warm up (CUDA: measures the peak memory), size
        and allocate the KV cache's tiers, capture the decode CUDA graphs, then start pinning host
        memory (all ranks). The sparse statistics start at zero after the first two."""
        if self.cache.storage.scaled:
            self._calibrate_key_offsets()
        if self.device.type == "cuda":
            self._warmup()
        self.cache.stats.reset()
        self.tier_sizes = self._tier_sizes()
        self.cache.allocate(self.tier_sizes)
        if self.captures_graphs:
            self.graphs = DecodeGraphs(self)
        self.cache.start_pinning()  # not while capturing: registering host memory would break a capture

    @torch.inference_mode()
    def _warmup(self):
        cfg = self.config
        gc.collect()  # an earlier engine's unreachable cycles still hold device memory until collected
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq_len = min(num_tokens, cfg.max_model_len)
        num_seqs = max(1, num_tokens // seq_len)
        # every rank warms up itself: nothing goes to the channel
        hidden = self._uncached_prefill(torch.zeros(seq_len * num_seqs, dtype=torch.int64, device=self.device),
                                        seq_len)
        self.model.compute_logits(hidden[seq_len - 1::seq_len])
        torch.cuda.empty_cache()

    def _uncached_prefill(self, input_ids: torch.Tensor, seq_len: int,
                          key_sums: torch.Tensor | None = None) -> torch.Tensor:
        """The model over ``input_ids`` (int64 ``[num_seqs * seq_len]`` on the device) as sequences
        of ``seq_len`` tokens from position 0, the KV cache untouched (warm-up, calibration; with
        ``key_sums``: ``Context.key_sums``): the hidden states."""
        num_seqs = input_ids.numel() // seq_len
        set_context(Context(is_prefill=True, seqlens_q=[seq_len] * num_seqs, seqlens_k=[seq_len] * num_seqs,
                            key_sums=key_sums))
        try:
            return self.model(input_ids, torch.arange(seq_len, device=self.device).repeat(num_seqs))
        finally:
            reset_context()

    @torch.inference_mode()
    def _calibrate_key_offsets(self):
        """An fp8 cache stores keys minus their mean over one prefill of seeded random tokens,
        per (layer, KV head, channel), after RoPE (``nanovllm.kvcache.key_offset``); every rank
        runs it (tensor parallelism: each for its own heads)."""
        cfg, g = self.config, self.cache.geometry
        ids = calibration_token_ids(cfg.hf_config.vocab_size, cfg.max_model_len).to(self.device)
        sums = torch.zeros(g.num_layers, g.num_kv_heads, g.head_dim, dtype=torch.float32, device=self.device)
        self._uncached_prefill(ids, ids.numel(), sums)
        self.cache.set_key_offsets(sums / ids.numel())

    def _tier_sizes(self) -> sizing.TierSizes:
        cfg, cache, geometry = self.config, self.cache, self.cache.geometry
        host = self._smallest_over_ranks(cache.host_blocks(self.ranks_on_host))
        gpu = self._smallest_over_ranks(sizing.gpu_blocks(
            cfg, geometry, self.device, cache.reserved_bytes(host), cache.metadata_bytes_per_block(),
            self.ranks_on_host))
        sizes = sizing.TierSizes(gpu, host)
        sizing.check_capacity(cfg, geometry, sizes, self.device)
        return sizes

    def _smallest_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value``: ranks size their caches from their own free
        memory, but must hold the same blocks, since one scheduler drives them all."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- rank plumbing -----------------------------------------------------------------
    def call(self, method: str, *args):
        """Run ``method`` on every rank (rank 0 broadcasts it first)."""
        if self.channel is not None and self.rank == 0:
            self.channel.send(method, *args)
        return getattr(self, method)(*args)

    def _worker_loop(self):
        while True:
            method, args = self.channel.receive()
            getattr(self, method)(*args)
            if method == "exit":
                break

    def exit(self):
        """Release graphs, KV cache and the process group (all ranks)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.cache is not None:
            self.cache.release()
        self._release_ranks()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _release_ranks(self):
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.world_size > 1:
            destroy_process_group(self.config.launch)

    # ---- running -----------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool,
                  sample_idx: list[int]) -> torch.Tensor:
        """Hidden states of the rows in ``sample_idx`` -> logits ``[len(sample_idx), vocab]``."""
        graphs = self.graphs
        if not is_prefill and graphs is not None and get_context().graph_batch:
            hidden = graphs.replay(input_ids, positions)
        else:
            hidden = self.model(input_ids, positions)
        if not sample_idx:
            return hidden.new_empty(0, 0)
        if len(sample_idx) < hidden.size(0):
            hidden = hidden[to_device(sample_idx, torch.int64, self.device)]
        return self.model.compute_logits(hidden)

    def run(self, seqs: list[Sequence], is_prefill: bool, generators: dict[int, torch.Generator] | None = None,
            moves: list[BlockMove] = (), input_ids: torch.Tensor | None = None) -> SampledStep | None:
        """One step for ``seqs``, after copying the scheduler's ``moves`` between the tiers
        (``nanovllm.kvcache.eviction.BlockMove``): a sampled token per sequence (none for an
        unfinished prefill chunk) and the logprobs asked for, on the device, not waited for. ``input_ids``: int64
        ``[len(seqs)]`` on the device, a decode step's inputs instead of the sequences' last
        tokens (async scheduling: the tokens the previous step sampled). Rank 0 samples; spawned
        workers return None."""
        if self.channel is not None and self.rank == 0:
            self.channel.send("run", seqs, is_prefill, None, moves)
        self.cache.begin_step(moves)
        step_ids, positions, sample_idx = self.cache.prepare(seqs, is_prefill)
        if input_ids is not None:
            step_ids[:len(seqs)] = input_ids
        rows = LogitRows(seqs, sample_idx, is_prefill)
        try:
            logits = self.run_model(step_ids, positions, is_prefill, rows.indices)
        finally:
            self.cache.finish_step()
        if self.channel is not None and self.rank > 0:
            return None  # a spawned worker: rank 0 samples
        if not rows.indices:
            return SampledStep.unsampled(len(seqs))
        sampled = [seq.samples_token for seq in seqs]
        return self.step_sampler(logits, rows, seqs, sampled, generators, None if is_prefill else step_ids)

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int], last: int | None = None) -> torch.Tensor:
        """float32 logits ``[len(token_ids), vocab]`` of one prompt (only the ``last`` positions
        when given: a 128K prompt's full logits would take 64 GB), without touching the KV cache
        (for scoring and for tests against a reference; rank 0 only)."""
        if self.world_size > 1:
            raise RuntimeError("forward_logits runs with tensor_parallel_size=1 only")
        n = len(token_ids)
        set_context(Context(is_prefill=True, seqlens_q=[n], seqlens_k=[n]))
        try:
            hidden = self.model(to_device(token_ids, torch.int64, self.device), torch.arange(n, device=self.device))
            return self.model.compute_logits(hidden if last is None else hidden[-last:]).float()
        finally:
            reset_context()
