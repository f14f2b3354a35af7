"""Runs the model for a scheduled batch: builds inputs, owns the KV cache and CUDA graphs.

One ModelRunner per tensor-parallel rank; every public method that touches the model runs on
all ranks with the same arguments. With spawned workers, rank 0 lives in the user's process and
drives the others through a :class:`RankChannel`; under torchrun each rank's engine makes the
same calls itself and rank 0's sampled tokens are broadcast (``tp_worker``).
"""
import logging
import os

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs, captured_batch_sizes
from nanovllm.engine.sampling_batch import LogitRows, StepOutput, StepSampler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_worker import (RankChannel, destroy_process_group, init_process_group, join,
                                       torchrun_rank)
from nanovllm.kvcache.hybrid_manager import HybridKVManager
from nanovllm.kvcache.offload_engine import OffloadEngine
from nanovllm.kvcache.sparse import create_policy
from nanovllm.layers.sampler import Sampler
from nanovllm.models import get_model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, OffloadBatch, reset_context, set_context
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.25
DECODE_BUFFER_SHARE = 4  # offload mode: decode buffers take at most 1/4 of the KV budget
_WARMUP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class ModelRunner:
    """Args: config, rank, the channel to spawned workers (None when TP is 1 or under
    torchrun), the rendezvous of a spawned engine (rank 0: its TCP ``store``; workers: the
    store's ``port``) and the CUDA device index on this host (``local_rank``, default ``rank``)."""

    def __init__(self, config: Config, rank: int, channel_name: str | None = None, events=None,
                 port: int = 0, local_rank: int | None = None, store=None):
        self.config = config
        self.rank, self.world_size = rank, config.tensor_parallel_size
        launch = torchrun_rank()
        self.ranks_on_host = launch.local_world_size if launch else self.world_size
        self.block_size = config.kvcache_block_size
        device_index = rank if local_rank is None else local_rank
        self.device = torch.device("cuda", device_index) if config.device == "cuda" else torch.device("cpu")
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            if channel_name and rank > 0:
                store = join(port, rank, self.world_size)
            init_process_group(config.device, rank, self.world_size, store)
        self.channel = None
        try:
            self.model = self._build_model()
            self.sampler = Sampler()
            self.generator = torch.Generator(self.device).manual_seed(config.seed)
            self.step_sampler = StepSampler(self.sampler, self.generator, config.eos_token_ids, rank,
                                            broadcast=self.world_size > 1 and channel_name is None)
            self.kv_cache = self.offload_engine = None
            self.graphs: DecodeGraphs | None = None
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
        """Bind the sparse policy, size and bind the KV cache, then capture decode CUDA graphs
        (all ranks)."""
        self._bind_policy()
        if self.device.type == "cuda":
            self._warmup()
            self.policy.stats.reset()
        if self.config.enable_cpu_offload:
            self.allocate_offload()
            return
        self.allocate_kv_cache(self._num_kv_blocks())
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.graphs = DecodeGraphs(self)

    @torch.inference_mode()
    def _warmup(self):
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq_len = min(num_tokens, cfg.max_model_len)
        seqs = [Sequence([0] * seq_len, _WARMUP_PARAMS, self.block_size)
                for _ in range(max(1, num_tokens // seq_len))]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self._run(seqs, True, None)  # every rank warms up itself: nothing goes to the channel
        torch.cuda.empty_cache()

    def kv_block_bytes(self) -> int:
        hf = self.config.hf_config
        heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * (heads // self.world_size) * head_dim
        return per_token * self.block_size * self.config.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            num_blocks = cfg.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self._gpu_budget() // self.kv_block_bytes()
        else:
            num_blocks = self._cpu_budget() // self.kv_block_bytes()
        num_blocks = self._smallest_over_ranks(num_blocks)
        capacity = num_blocks * self.block_size
        if capacity < cfg.max_model_len:
            raise RuntimeError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} = {capacity} tokens, fewer "
                f"than max_model_len={cfg.max_model_len}: not enough memory for one sequence "
                f"(block = {self.kv_block_bytes()} bytes); lower max_model_len or give more memory")
        return num_blocks

    def _smallest_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value``: ranks size their caches from their own free
        memory, but must hold the same blocks and rows, since one scheduler drives them all."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def _host_memory_share(self, fraction: float) -> int:
        """Bytes of this host's available memory for this rank: ``fraction`` of it, split evenly
        between the ranks on this host."""
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(available * fraction) // self.ranks_on_host

    def _gpu_budget(self) -> int:
        """Bytes for KV: this process's share of the GPU minus its own peak use (weights,
        activations of the warm-up), never more than what is free now."""
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak
        return max(0, min(budget, free - (256 << 20)))

    def _cpu_budget(self) -> int:
        """Bytes for KV on CPU: enough for max_num_seqs full sequences, capped at a fraction of
        available host memory."""
        cfg = self.config
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        wanted = cfg.max_num_seqs * blocks_per_seq * self.kv_block_bytes()
        return min(wanted, self._host_memory_share(CPU_KV_MEMORY_FRACTION))

    def _attention_layers(self) -> list[torch.nn.Module]:
        return [m for m in self.model.modules() if hasattr(m, "k_cache")]

    def _bind_policy(self):
        """The sparse policy of ``config.sparse_policy``, bound to every attention layer: offload
        mode runs its chunked pipeline, GPU-only mode its prefill attention (bound before the
        warm-up, so that its kernels and buffers are part of the measured peak)."""
        layers = self._attention_layers()
        self.policy = create_policy(self.config, layers[0].scale)
        for i, module in enumerate(layers):
            module.layer_id, module.policy = i, self.policy

    def allocate_offload(self):
        """Host KV blocks, GPU ring buffer and decode rows of offload mode, bound to every layer."""
        cfg, layers = self.config, self._attention_layers()
        layer = layers[0]
        row_bytes = self.kv_block_bytes()  # one block of every layer, K and V
        fixed = (cfg.num_gpu_blocks + len(layers)) * row_bytes // len(layers) + row_bytes
        budget = self._gpu_budget() if self.device.type == "cuda" else self._cpu_budget()
        rows = (budget - fixed) // DECODE_BUFFER_SHARE // row_bytes
        self.num_decode_rows = self._smallest_over_ranks(max(1, min(cfg.max_num_seqs, rows)))
        num_cpu_blocks = self._num_cpu_blocks()
        self.offload_engine = OffloadEngine(
            len(layers), layer.num_kv_heads, layer.head_dim, cfg.dtype, self.device,
            self.block_size, num_cpu_blocks, cfg.num_gpu_blocks, self.num_decode_rows)
        self.policy.initialize(self.offload_engine)
        for module in layers:
            module.offload_engine = self.offload_engine
        self.num_kv_blocks = num_cpu_blocks
        if self.device.type == "cuda":
            self.compute_stream = torch.cuda.Stream(self.device)
        logger.info("offload: %d CPU blocks x %d tokens, %d ring slots, %d decode rows, policy %s",
                    num_cpu_blocks, self.block_size, cfg.num_gpu_blocks, self.num_decode_rows,
                    cfg.sparse_policy.value)

    def _num_cpu_blocks(self) -> int:
        cfg = self.config
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        if cfg.num_cpu_kvcache_blocks > 0:
            num_blocks = cfg.num_cpu_kvcache_blocks
        else:
            budget = self._host_memory_share(cfg.cpu_memory_utilization) // self.kv_block_bytes()
            num_blocks = self._smallest_over_ranks(min(budget, self.num_decode_rows * blocks_per_seq))
        if num_blocks < blocks_per_seq:
            raise RuntimeError(
                f"host KV cache of {num_blocks} blocks x {self.block_size} tokens cannot hold one "
                f"sequence of max_model_len={cfg.max_model_len} ({blocks_per_seq} blocks of "
                f"{self.kv_block_bytes()} bytes); give more host memory or lower max_model_len")
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int):
        hf = self.config.hf_config
        attn_layers = self._attention_layers()
        layer = attn_layers[0]
        try:
            self.kv_cache = torch.zeros(2, len(attn_layers), num_blocks, self.block_size,
                                        layer.num_kv_heads, layer.head_dim,
                                        dtype=self.config.dtype, device=self.device)
        except RuntimeError as err:
            raise RuntimeError(f"cannot allocate the KV cache: num_kvcache_blocks={num_blocks} x "
                               f"{self.kv_block_bytes()} bytes = {num_blocks * self.kv_block_bytes() / 2**30:.1f} "
                               f"GiB on {self.device}: {err}") from err
        for i, module in enumerate(attn_layers):
            module.k_cache, module.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.num_kv_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB), %d layers of %s", num_blocks,
                    self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
                    hf.num_hidden_layers, self.config.dtype)

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
        for m in self.model.modules():
            if hasattr(m, "k_cache"):
                m.k_cache = m.v_cache = torch.tensor([])
        self.kv_cache = self.offload_engine = None
        self._release_ranks()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _release_ranks(self):
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.world_size > 1:
            destroy_process_group()

    # ---- inputs ------------------------------------------------------------------------
    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _slot(self, seq: Sequence, pos: int) -> int:
        if pos < seq.num_cached_tokens:  # a cached, shared block: its KV is already there
            return -1
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        return self._tensor(rows, torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slots, seqlens_q, seqlens_k, sample_idx = [], [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            if self.kv_cache is not None:
                slots += [self._slot(seq, p) for p in range(start, end)]
            seqlens_q.append(end - start)
            seqlens_k.append(end)
            if end == len(seq):
                sample_idx.append(len(input_ids) - 1)
        has_prefix = any(k > q for q, k in zip(seqlens_q, seqlens_k))
        set_context(Context(
            is_prefill=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
            slot_mapping=self._tensor(slots, torch.int64) if slots else None,
            block_tables=self._block_tables(seqs) if has_prefix else None))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), sample_idx

    def prepare_offload_prefill(self, seqs: list[Sequence]):
        """One sequence, one chunk of at most one block, offloaded to its next CPU block."""
        (seq,) = seqs
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        chunk = start // self.block_size
        set_context(Context(is_prefill=True, seqlens_q=[n], seqlens_k=[start + n], offload=OffloadBatch(
            cpu_blocks=[seq.block_table[:chunk]], block_lens=[[self.block_size] * chunk],
            chunk_blocks=[seq.block_table[chunk]])))
        sample_idx = [n - 1] if start + n == len(seq) else []
        return (self._tensor(seq.token_ids[start:start + n], torch.int64),
                self._tensor(list(range(start, start + n)), torch.int64), sample_idx)

    def prepare_offload_decode(self, seqs: list[Sequence]):
        self.offload_engine.drop_prefetches()
        cpu_blocks, block_lens, offsets = [], [], []
        for seq in seqs:
            pos = len(seq) - 1
            num = HybridKVManager.num_offloaded_blocks(seq, pos)
            cpu_blocks.append(seq.block_table[:num])
            block_lens.append(HybridKVManager.block_lens(seq, num))
            offsets.append(HybridKVManager.decode_offset(seq, pos))
        rows = [seq.decode_row for seq in seqs]
        set_context(Context(is_prefill=False, offload=OffloadBatch(
            cpu_blocks=cpu_blocks, block_lens=block_lens, decode_rows=rows,
            decode_lens=[o + 1 for o in offsets], rows=self._tensor(rows, torch.int64),
            offsets=self._tensor(offsets, torch.int64))))
        return (self._tensor([seq.last_token for seq in seqs], torch.int64),
                self._tensor([len(seq) - 1 for seq in seqs], torch.int64), list(range(len(seqs))))

    def _offload_full_decode_blocks(self, seqs: list[Sequence]):
        """After a decode step: move every decode buffer that just became full to its CPU block."""
        for seq in seqs:
            if HybridKVManager.decode_offset(seq, len(seq) - 1) == self.block_size - 1:
                self.offload_engine.offload_decode_block(seq.decode_row, seq.block_table[-1])
                self.policy.on_decode_offload(seq.block_table[-1], self.offload_engine.decode_block(seq.decode_row))

    def prepare_decode(self, seqs: list[Sequence]):
        """Decode inputs. On CUDA the batch is padded to the next captured graph size and the
        block table to its full width, with or without graphs, so eager and graph decode run the
        same kernels on the same shapes and give identical tokens."""
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slots = [self._slot(seq, len(seq) - 1) for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        width = max(map(len, tables))
        if self.device.type == "cuda":
            cfg = self.config
            pad = next((s for s in captured_batch_sizes(cfg.max_num_seqs) if s >= len(seqs)), len(seqs)) - len(seqs)
            input_ids, positions = input_ids + [0] * pad, positions + [0] * pad
            slots, context_lens, tables = slots + [-1] * pad, context_lens + [0] * pad, tables + [[]] * pad
            width = max(width, -(-cfg.max_model_len // self.block_size))
        set_context(Context(
            is_prefill=False, slot_mapping=self._tensor(slots, torch.int64),
            context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._tensor([t + [-1] * (width - len(t)) for t in tables], torch.int32)))
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64),
                list(range(len(seqs))))

    # ---- running -----------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool,
                  sample_idx: list[int]) -> torch.Tensor:
        """Hidden states of the rows in ``sample_idx`` -> logits ``[len(sample_idx), vocab]``."""
        if not is_prefill and self.graphs is not None and self.graphs.fits(input_ids.size(0)):
            hidden = self.graphs.replay(input_ids, positions)
        else:
            hidden = self.model(input_ids, positions)
        if not sample_idx:
            return hidden.new_empty(0, 0)
        if len(sample_idx) < hidden.size(0):
            hidden = hidden[self._tensor(sample_idx, torch.int64)]
        return self.model.compute_logits(hidden)

    def run(self, seqs: list[Sequence], is_prefill: bool,
            generators: dict[int, torch.Generator] | None = None) -> StepOutput | list:
        """One step for ``seqs``: a sampled token per sequence (None for an unfinished prefill
        chunk) and the logprobs asked for. Rank 0 samples; spawned workers return an empty list."""
        if self.channel is not None and self.rank == 0:
            self.channel.send("run", seqs, is_prefill)
        if self.offload_engine is not None and self.device.type == "cuda":
            with torch.cuda.stream(self.compute_stream):
                return self._run(seqs, is_prefill, generators)
        return self._run(seqs, is_prefill, generators)

    def _prepare(self, seqs: list[Sequence], is_prefill: bool):
        if self.offload_engine is None:
            return (self.prepare_prefill if is_prefill else self.prepare_decode)(seqs)
        return (self.prepare_offload_prefill if is_prefill else self.prepare_offload_decode)(seqs)

    def _run(self, seqs: list[Sequence], is_prefill: bool, generators) -> StepOutput | list:
        input_ids, positions, sample_idx = self._prepare(seqs, is_prefill)
        rows = LogitRows(seqs, sample_idx, is_prefill)
        logits = self.run_model(input_ids, positions, is_prefill, rows.indices)
        reset_context()
        if self.offload_engine is not None and not is_prefill:
            self._offload_full_decode_blocks(seqs)
        if not rows.indices:
            return StepOutput([None] * len(seqs))
        if self.channel is not None and self.rank > 0:
            return []  # a spawned worker: rank 0 samples
        sampled = [not is_prefill or self._finishes_prefill(seq) for seq in seqs]
        return self.step_sampler(logits, rows, seqs, sampled, generators)

    @staticmethod
    def _finishes_prefill(seq: Sequence) -> bool:
        return seq.num_computed_tokens + seq.num_scheduled_tokens == len(seq)

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
            hidden = self.model(self._tensor(token_ids, torch.int64),
                                torch.arange(n, device=self.device))
            return self.model.compute_logits(hidden if last is None else hidden[-last:]).float()
        finally:
            reset_context()

