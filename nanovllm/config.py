"""Engine configuration, validated at construction."""
import json
import logging
import os
import warnings
from dataclasses import MISSING, dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.parallel.launch import Launch, resolve_launch
from nanovllm.sampling_params import SEED_MAX, SEED_MIN
from nanovllm.sparse import (DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET, check_unused_options,
                             choosing_policy_names, policy_class)
from nanovllm.sparse.choosing import check_layer_weights
from nanovllm.utils.checks import check_bool, check_count_or_auto, check_range, is_integer
from nanovllm.utils.dtypes import check_kv_cache_device, resolve_kv_cache_dtype, resolve_model_dtype
from nanovllm.vllm_compat import check_vllm_args

logger = logging.getLogger(__name__)

BLOCK_SIZE_MULTIPLE = 256


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
    return device


_DEPRECATED_NAMES = ("num_gpu_blocks", "sparse_topk_blocks")
"""Config fields kept for old callers (each warns and says its new name); not listed in errors."""

_VLLM_HINTS = {
    "num_scheduler_steps": "multi-step scheduling is gone from vLLM too; async_scheduling overlaps steps",
    "use_v2_block_manager": "the KV cache is nanovllm's own two-tier block manager",
    "preemption_mode": "a preempted sequence is recomputed (and the host tier spills before anyone is preempted)",
    "max_context_len_to_capture": "decode graphs cover every context length",
}
"""Hints for arguments of older vLLM releases that neither vLLM nor nanovllm takes now."""

_NONE_IS_DEFAULT = ("max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching", "seed")
"""Config fields for which None (vLLM's default) means nanovllm's default; ``max_model_len`` None is
the model's ``max_position_embeddings``, as in vLLM."""

_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_engine_args(kwargs: dict) -> dict:
    """The keywords of ``LLM(...)`` that are :class:`Config` fields: vLLM's arguments at values
    that are a no-op here are dropped (``nanovllm.vllm_compat``).

    Raises:
        ValueError: a vLLM argument asking for behaviour this engine lacks (naming it and what is
            supported); a keyword that is neither a vLLM argument nor a Config field (naming every
            such keyword, with a hint for those of older vLLM releases), ``eos_token_ids`` too,
            which the engine takes from the model's generation config.
    """
    known = {f.name for f in fields(Config) if f.init and f.name not in ("model", "eos_token_ids")}
    kwargs = check_vllm_args(kwargs, known)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        hints = "".join(f"; {name}: {_VLLM_HINTS[name]}" for name in unknown if name in _VLLM_HINTS)
        listed = sorted(known - set(_DEPRECATED_NAMES))
        raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}{hints} (nanovllm's arguments are "
                         f"revision, download_dir, tokenizer_revision, vLLM's arguments in "
                         f"nanovllm.vllm_compat.VLLM_ARGS and the fields of nanovllm.config.Config: {', '.join(listed)})")
    return kwargs


def load_hf_config(model: str) -> PretrainedConfig:
    """The transformers config of the model directory ``model``, its ``config.json`` checked
    first so that a broken file is named with what is wrong in it.

    Raises:
        ValueError: no config.json; not valid JSON (with the line and column); not a JSON object;
            missing one of the keys every supported decoder needs; transformers refuses it.
    """
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {model!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    missing = [key for key in _REQUIRED_CONFIG_KEYS if key not in raw and key not in raw.get("text_config", {})]
    if missing:
        raise ValueError(f"{path} has no {', '.join(repr(k) for k in missing)}: a decoder's config.json needs "
                         f"{', '.join(_REQUIRED_CONFIG_KEYS)}")
    try:
        return AutoConfig.from_pretrained(model)
    except Exception as err:  # transformers' own validation (ValueError, OSError, strict-dataclass errors)
        raise ValueError(f"{path}: transformers cannot load this config: {type(err).__name__}: {err}") from err


@dataclass
class Config:
    """Everything the engine needs to know, checked once.

    Attributes:
        model: HF model directory with ``config.json`` and safetensors weights.
        tokenizer: directory (or Hub id, resolved as ``model`` is) of the tokenizer; None: ``model``
            (vLLM's ``tokenizer``).
        trust_remote_code: passed to transformers when loading the tokenizer (vLLM's name); the
            model itself always runs nanovllm's own code (Llama, Mistral with its sliding window,
            Qwen2, Qwen3).
        enable_prefix_caching: vLLM's switch; prefix caching is part of nanovllm's KV cache and
            always on, so only True (the default) and None (vLLM's default) are accepted.
        max_num_batched_tokens: token budget of one prefill step (>= 1); longer prompts are
            prefilled in chunks of at most this many tokens. None (vLLM's default): 16384.
        max_num_seqs: most sequences in one step (>= 1); also the largest CUDA-graph batch. None:
            512.
        max_model_len: longest prompt + output in tokens; clamped to the model's
            ``max_position_embeddings``. None (vLLM's default): the model's
            ``max_position_embeddings``.
        gpu_memory_utilization: fraction of GPU memory this process may use, in (0, 1].
        tensor_parallel_size: ranks of one replica (>= 1); must divide the head counts.
        data_parallel_size: replicas (>= 1), each of ``tensor_parallel_size`` ranks; ``generate``
            splits the prompts across them (``nanovllm.parallel.data_parallel``). Spawned on this
            host (CUDA: needs ``data_parallel_size * tensor_parallel_size`` GPUs), or under
            torchrun, where WORLD_SIZE must equal ``data_parallel_size * tensor_parallel_size``.
        enforce_eager: disable CUDA graphs for decode.
        async_scheduling: overlap the host's scheduling and input preparation of a step (decode,
            or a prefill chunk) with the device's previous step (vLLM's name; ``nanovllm.engine.step_loop`` says
            when it overlaps). None (default): on where it can be, i.e. on CUDA with
            ``tensor_parallel_size`` 1, whatever the sparse policy, with or without the host tier,
            else off; the resolved bool is stored here. True forces it (ValueError where
            unsupported; on CPU nothing overlaps, but the same code path runs, which is what its
            CPU tests use); False is the synchronous loop, for debugging. Outputs are identical
            either way (``tests/gpu/test_async_scheduling_gpu.py``); its gain on ``bench.py``:
            ``docs/benchmarks.md``, 'Throughput'.
        kvcache_block_size: tokens per KV block, a positive multiple of 256.
        num_kvcache_blocks: GPU-tier KV blocks; -1 sizes the tier from free memory (see
            ``nanovllm.kvcache.sizing``).
        dtype: "float32" | "float16" | "bfloat16" | torch dtype | None or "auto" (the model's on
            GPU, float32 on CPU).
        kv_cache_dtype: what the KV cache stores (vLLM's names): "auto" (the model's ``dtype``),
            "fp8" (= "fp8_e4m3", torch.float8_e4m3fn) or "fp8_e5m2" (torch.float8_e5m2), with
            float32 scales per (token, KV head) for keys and values, keys stored minus a
            calibrated offset that attention does not see (``docs/kvcache.md``, "FP8 KV");
            ``kv_storage_dtype`` is the resolved torch dtype. On CUDA, "fp8" / "fp8_e4m3"
            needs compute capability >= 8.9 on every device the engine uses (ValueError
            otherwise: ``nanovllm.utils.dtypes.check_kv_cache_device``).
        device: "auto" (cuda if available else cpu) | "cuda" | "cpu".
        seed: seed of the engine's sampling generator; None (vLLM's default): 0.
        max_logprobs: most top-k logprobs a request may ask for (``logprobs``, ``prompt_logprobs``;
            their -1 is the vocabulary), vLLM's option and default (20); -1: no limit.
        enable_cpu_offload: turn on the host tier of the KV cache: blocks the GPU tier cannot hold
            are spilled to pinned host memory and read back through a GPU ring buffer of
            ``num_ring_slots`` slots; freed prefix-cache blocks the GPU tier reuses are written
            back there (a second-level prefix cache). Host memory is pinned on demand, in chunks
            (``docs/kvcache.md``).
        num_ring_slots: ring-buffer slots of the host tier (one layer of one block each, read in
            two halves: ``nanovllm.kvcache.ring``), >= 2; None: as many as
            ``sizing.RING_BYTES`` (128 MiB) hold, at least 4 (``num_gpu_blocks`` is its deprecated
            name).
        num_cpu_kvcache_blocks: host-tier blocks; -1 sizes them from ``cpu_memory_utilization`` of
            the available host memory (at most what ``max_num_seqs`` sequences of
            ``max_model_len`` tokens use).
        cpu_memory_utilization: share of available host memory the host tier may use (and pin as
            it fills), in (0, 1].
        sparse_policy: "FULL" (every block), "QUEST" (decode: pages chosen per KV head by key
            min/max bounds, in both tiers), "STREAMING" (decode: attention sinks and a recent
            window), "XATTN_BSA" (prefill: XAttention block-sparse attention, Xu et al. 2025;
            decode is full), "MOMENTS" (QUEST's plan, pages scored by a Gaussian estimate of their
            attention mass from their keys' mean and variance) or "ORACLE" (QUEST's choice by
            exact attention mass: a measurement, not a speed-up); see ``docs/sparse.md``.
            ``LLM.get_sparse_stats()`` reports the densities.
        sparse_page_size: QUEST / STREAMING: tokens per page, the unit decode chooses and reads
            per KV head; 16, 32 or 64, dividing ``kvcache_block_size``.
        sparse_token_budget: QUEST: tokens each KV head reads per decode step besides the
            always-read ones (rounded up to whole pages), >= 1.
        sparse_layer_budget_weights: QUEST / MOMENTS / ORACLE: None (default: every layer picks
            ``sparse_token_budget``) or a list or tuple of one weight > 0 per layer
            (``num_hidden_layers``): layer ``l`` picks ``sparse_token_budget x w[l] / mean(w)``
            tokens per KV head (whole pages, at least one), so the layers share about the same
            total unequally (``nanovllm.sparse.choosing.layer_budget_pages``; the first
            ``sparse_dense_layers`` read everything whatever their weight). Fitted per model by
            ``python -m benchmarks.layer_budgets`` (its report's ``"weights"``).
        sparse_sink_tokens, sparse_recent_tokens: QUEST / STREAMING: the first tokens (attention
            sinks) and the last tokens before the page being written, which every decode step reads
            (rounded up to whole pages), in [0, max_model_len].
        sparse_dense_layers: QUEST / STREAMING: the first layers read every page, 0 to num_hidden_layers.
        sparse_group_score: QUEST: how a KV head combines its query heads' page shares, "sum"
            (default) or "max".
        sparse_radius_weight: QUEST: weight of a page's key radius in its score, in [0, 1]: 1.0
            is Quest's upper bound of ``q . k``, 0.0 the score of the page's key-box center
            (default 0.5).
        sparse_topk_blocks: deprecated: ``sparse_token_budget = sparse_topk_blocks x
            kvcache_block_size`` (warns; giving both is a ValueError).
        num_reuse_cache_blocks: a choosing policy with the host tier: GPU blocks (of every layer)
            whose pages keep, per KV head, host-tier pages read in recent decode steps, so a page
            read again is read in place instead of loaded again (``docs/kvcache.md``); taken from
            the GPU tier's memory budget. -1 (default): room for twice a step's picks of one
            sequence (``nanovllm.kvcache.reuse.DEFAULT_ROWS_PER_PICK``); 0: no reuse cache. A
            positive value needs ``enable_cpu_offload`` and a policy that chooses decode pages.
        sparse_threshold: XATTN_BSA, share of the estimated attention mass each (head, query
            block) keeps, in [0, 1] (default 0.97, the knee of the RULER sweep at 32K in docs/sparse.md;
            1.0 keeps every block: FULL's result).
        sparse_stride: XATTN_BSA antidiagonal stride of the estimation, a power of two in
            [1, 64] and <= sparse_block_size (default 8; 16 is cheaper and coarser).
        sparse_block_size: XATTN_BSA sparse block in tokens, a power of two in [16, 1024]
            (default 128).
        sparse_chunk_size: XATTN_BSA: query rows estimated per call, a multiple of
            sparse_block_size (default 16384); bounds the estimation's memory.

    A sparse option (a field some registered policy lists in its ``options``) set to another value
    than its default while ``sparse_policy`` names a policy that does not read it is refused.

    Raises:
        ValueError: a bad field, naming the field, the value and the limit; the model directory
            missing, a file, or its config.json unreadable (see :func:`load_hf_config`).
    """

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    enable_prefix_caching: bool | None = True
    max_num_batched_tokens: int | None = 16384
    max_num_seqs: int | None = 512
    max_model_len: int | None = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    dtype: object = None
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int | None = 0
    max_logprobs: int = 20
    enable_cpu_offload: bool = False
    num_ring_slots: int | None = None
    num_gpu_blocks: int | None = None  # deprecated name of num_ring_slots
    num_cpu_kvcache_blocks: int = -1
    cpu_memory_utilization: float = 0.5
    sparse_policy: str = "FULL"
    sparse_page_size: int = 16
    sparse_token_budget: int = DEFAULT_TOKEN_BUDGET
    sparse_layer_budget_weights: tuple[float, ...] | None = None
    sparse_sink_tokens: int = 16
    sparse_recent_tokens: int = 256
    sparse_dense_layers: int = 0
    sparse_group_score: str = DEFAULT_GROUP_SCORE
    sparse_radius_weight: float = DEFAULT_RADIUS_WEIGHT
    sparse_topk_blocks: int | None = None  # deprecated: sparse_token_budget = it x kvcache_block_size
    num_reuse_cache_blocks: int = -1
    sparse_threshold: float = 0.97
    sparse_stride: int = 8
    sparse_block_size: int = 128
    sparse_chunk_size: int = 16384
    hf_config: PretrainedConfig = field(init=False, repr=False)
    kv_storage_dtype: torch.dtype = field(init=False, repr=False)
    launch: Launch = field(init=False, repr=False)
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if os.path.isfile(self.model):
            raise ValueError(f"model {self.model!r} is a file; the model is a directory with config.json and "
                             f"safetensors weights")
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist")
        for name in _NONE_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, FIELD_DEFAULTS[name])
        for name in ("trust_remote_code", "enable_prefix_caching", "enforce_eager", "enable_cpu_offload"):
            check_bool(name, getattr(self, name))
        if not self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching=False is not supported: prefix caching is part of nanovllm's "
                             "KV cache (a block is reused only when its tokens and all before them match)")
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_range("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            check_range("max_model_len", self.max_model_len, 1)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_inclusive=False,
                     integer=False)
        check_range("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_range("data_parallel_size", self.data_parallel_size, 1)
        block = self.kvcache_block_size
        if not is_integer(block) or block <= 0 or block % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"kvcache_block_size must be a positive multiple of "
                             f"{BLOCK_SIZE_MULTIPLE}, got {block!r}")
        check_count_or_auto("num_kvcache_blocks", self.num_kvcache_blocks)
        check_range("seed", self.seed, SEED_MIN, SEED_MAX)
        check_range("max_logprobs", self.max_logprobs, -1)
        self.device = _resolve_device(self.device)
        self.hf_config = load_hf_config(self.model)
        self.dtype = resolve_model_dtype(self.dtype, self.hf_config, self.device)
        self.kv_storage_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        if self.max_model_len is None:
            self.max_model_len = self.hf_config.max_position_embeddings
        if self.max_model_len > self.hf_config.max_position_embeddings:
            logger.warning("max_model_len=%d is above the model's max_position_embeddings=%d; using %d",
                           self.max_model_len, self.hf_config.max_position_embeddings,
                           self.hf_config.max_position_embeddings)
            self.max_model_len = self.hf_config.max_position_embeddings
        self._check_offload()  # the sparse options' limits: max_model_len, the model's layers
        self._check_parallel()
        if self.device == "cuda":
            check_kv_cache_device(self.kv_cache_dtype, self.kv_storage_dtype, self.launch.cuda_devices)
        self._check_async_scheduling()

    def _check_async_scheduling(self):
        """Resolve ``async_scheduling`` None to a bool; refuse True where it cannot run."""
        blockers = async_scheduling_blockers(self)
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda" and not blockers
            return
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None (on where supported), True or False, "
                             f"got {self.async_scheduling!r}")
        if self.async_scheduling and blockers:
            raise ValueError(f"async_scheduling=True does not support {', '.join(blockers)}; "
                             f"use async_scheduling=False or None")

    def _check_offload(self):
        if self.num_gpu_blocks is not None:
            warnings.warn("num_gpu_blocks is deprecated and will be removed in the next release: it means the "
                          "host tier's ring slots; use num_ring_slots", DeprecationWarning, stacklevel=5)
            check_range("num_gpu_blocks", self.num_gpu_blocks, 2)
            self.num_ring_slots, self.num_gpu_blocks = self.num_gpu_blocks, None
        if self.num_ring_slots is not None:
            check_range("num_ring_slots", self.num_ring_slots, 2)
            if not self.enable_cpu_offload:
                raise ValueError(f"num_ring_slots={self.num_ring_slots} sizes the host tier's ring, which needs "
                                 "enable_cpu_offload=True")
        check_count_or_auto("num_cpu_kvcache_blocks", self.num_cpu_kvcache_blocks)
        if self.num_cpu_kvcache_blocks != -1:
            if not self.enable_cpu_offload:
                raise ValueError(f"num_cpu_kvcache_blocks={self.num_cpu_kvcache_blocks} sizes the host tier, which "
                                 "needs enable_cpu_offload=True")
        check_range("cpu_memory_utilization", self.cpu_memory_utilization, 0, 1, low_inclusive=False,
                     integer=False)
        self.sparse_policy = policy_class(self.sparse_policy).name
        if self.sparse_topk_blocks is not None:
            warnings.warn("sparse_topk_blocks is deprecated and will be removed in the next release: decode chooses "
                          "pages per KV head; use sparse_token_budget (tokens per KV head and step)",
                          DeprecationWarning, stacklevel=5)
            check_range("sparse_topk_blocks", self.sparse_topk_blocks, 1)
            if self.sparse_token_budget != DEFAULT_TOKEN_BUDGET:
                raise ValueError(f"sparse_topk_blocks={self.sparse_topk_blocks} and sparse_token_budget="
                                 f"{self.sparse_token_budget} both set the budget; give sparse_token_budget only")
            self.sparse_token_budget = self.sparse_topk_blocks * self.kvcache_block_size
            self.sparse_topk_blocks = None
        if self.sparse_layer_budget_weights is not None:
            self.sparse_layer_budget_weights = check_layer_weights(self.sparse_layer_budget_weights,
                                                                   self.hf_config.num_hidden_layers)
        policy_class(self.sparse_policy).check_options(self)  # another policy's options must keep their defaults:
        check_unused_options(self, FIELD_DEFAULTS)
        check_count_or_auto("num_reuse_cache_blocks", self.num_reuse_cache_blocks, 0)
        if self.num_reuse_cache_blocks > 0 and not (self.enable_cpu_offload and
                                                    policy_class(self.sparse_policy).chooses_decode_pages):
            choosers = " or ".join(repr(name) for name in choosing_policy_names())
            raise ValueError(f"num_reuse_cache_blocks={self.num_reuse_cache_blocks} needs enable_cpu_offload=True "
                             f"and sparse_policy={choosers} (got {self.enable_cpu_offload}, "
                             f"{self.sparse_policy!r}); use -1 or 0")

    def _check_parallel(self):
        """Resolve the launch (``self.launch``, read once here) and check the parallel sizes."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        ranks = f"tensor_parallel_size={tp}" if dp == 1 else \
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}"
        self.launch = launch = resolve_launch(tp, dp)
        if launch.torchrun and launch.world_size != dp * tp:
            raise ValueError(f"{ranks} must equal the {launch.world_size} processes torchrun started (WORLD_SIZE)")
        if not launch.torchrun and self.device == "cuda" and dp * tp > torch.cuda.device_count():
            raise ValueError(f"{ranks} ranks need as many GPUs on this host, found {torch.cuda.device_count()}")
        cfg = self.hf_config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        for name, value in (("num_attention_heads", cfg.num_attention_heads),
                            ("num_key_value_heads", kv_heads)):
            if value % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide "
                                 f"{name}={value}")


FIELD_DEFAULTS = {f.name: f.default for f in fields(Config) if f.default is not MISSING}
"""Each ``Config`` option's default (options without one left out)."""


def async_scheduling_blockers(config: Config) -> list[str]:
    """The settings of ``config`` that async scheduling cannot run with (empty: it can), named
    as in the ValueError: tensor parallelism. The host KV tier runs with it (its moves between the
    tiers are decided ahead and copied in order: ``nanovllm.engine.step_loop``), and so does a policy
    that chooses decode pages: its picks, page tables and reuse cache stay on the device, and the
    step's selection is built on the host from the block tables the scheduler fixed ahead."""
    return [f"tensor_parallel_size={config.tensor_parallel_size}"] if config.tensor_parallel_size > 1 else []
