"""Engine plumbing shared by the evaluations (``tests/test_needle.py``, ``tests/test_ruler.py``,
:mod:`tools.ruler.evaluation`, ``benchmarks/ruler_sweep.py``): the engine/offload settings with
their validation and :class:`nanovllm.LLM` keyword arguments, the matching command-line options,
the model-directory resolution, :func:`make_llm`, :func:`engine_offload`, :func:`sparse_options`
and :func:`sparse_stats_text`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from nanovllm.sparse import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
ENGINE_FIELDS = ("enable_offload", "num_ring_slots", "num_gpu_kv_blocks", "block_size", "sparse_policy",
                 "sparse_page_size", "sparse_token_budget", "sparse_sink_tokens", "sparse_recent_tokens",
                 "sparse_dense_layers", "sparse_group_score", "sparse_radius_weight", "sparse_layer_budget_weights",
                 "sparse_topk_blocks", "sparse_threshold", "sparse_stride",
                 "num_cpu_blocks", "num_reuse_cache_blocks", "device", "dtype", "kv_cache_dtype", "enforce_eager",
                 "gpu_memory_utilization")


@dataclass
class EngineSettings:
    """The engine's offload/runtime options. Subclasses define ``max_model_len`` (the tokens one
    sequence needs), check their own fields first and then call ``super().validate()``.

    With ``enable_offload`` (the host tier), ``num_gpu_kv_blocks=None`` gives the GPU tier the
    fewest blocks the engine allows, 2 per sequence (its first block and the block it writes), so
    the host tier holds everything else and decode reads it from there (through the ring, or, for a
    policy that chooses decode pages, its pages gathered per KV head); ``num_cpu_blocks=None``
    gives the host tier exactly what ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
    """

    enable_offload: bool = False
    num_ring_slots: int | None = None  # the engine's default
    num_gpu_kv_blocks: int | None = None
    block_size: int = 1024
    sparse_policy: str = "FULL"
    sparse_page_size: int = 16  # QUEST / STREAMING: tokens per page, chosen per KV head in decode
    sparse_token_budget: int = DEFAULT_TOKEN_BUDGET  # QUEST: tokens each KV head picks per decode step
    sparse_sink_tokens: int = 16  # QUEST / STREAMING: always-read first tokens
    sparse_recent_tokens: int = 256  # QUEST / STREAMING: always-read last tokens
    sparse_dense_layers: int = 0  # QUEST / STREAMING: the first layers read everything
    sparse_group_score: str = DEFAULT_GROUP_SCORE  # QUEST: "sum" or "max" over a KV head's query heads
    sparse_radius_weight: float = DEFAULT_RADIUS_WEIGHT  # QUEST: 1.0 the key bound, 0.0 the key box's center
    sparse_layer_budget_weights: tuple[float, ...] | None = None  # QUEST: the budget's share per layer (the engine checks)
    sparse_topk_blocks: int | None = None  # deprecated: sparse_token_budget = it x block_size (the engine warns)
    sparse_threshold: float = 0.97
    sparse_stride: int = 8
    num_cpu_blocks: int | None = None
    num_reuse_cache_blocks: int | None = None  # None: the engine's default (2 cells per page a sequence picks)
    device: str = "auto"
    dtype: str | None = None  # None: the engine's default (model dtype on GPU, float32 on CPU)
    kv_cache_dtype: str = "auto"  # the KV cache's storage: "auto" (the compute dtype), "fp8", "fp8_e4m3", "fp8_e5m2"
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None  # None: the engine's default

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def validate(self) -> None:
        """Raise ValueError naming the option, the value and the limit (the engine options)."""
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in (None, *DTYPE_CHOICES[1:]):
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        from nanovllm.utils.dtypes import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size % 256:
            raise ValueError(f"block-size must be a positive multiple of 256, got {self.block_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._validate_sparse()
        if not self.enable_offload:
            return
        if self.num_ring_slots is not None and self.num_ring_slots < 2:
            raise ValueError(f"num-ring-slots must be >= 2, got {self.num_ring_slots}")
        if self.num_gpu_kv_blocks is not None and self.num_gpu_kv_blocks < 2:
            raise ValueError(f"num-gpu-kv-blocks must be >= 2 with the host tier, got {self.num_gpu_kv_blocks}")
        need = -(-self.max_model_len // self.block_size)
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < need:
            raise ValueError(f"num-cpu-blocks={self.num_cpu_blocks} cannot hold input-len + "
                             f"max-new-tokens = {self.max_model_len} tokens: {need} blocks of "
                             f"{self.block_size} are needed")

    def _validate_sparse(self) -> None:
        """The sparse options, as the engine checks them (every policy's options, whichever is
        selected; XATTN_BSA applies without offload too), except that the always-read tokens are
        held to ``max_model_len`` only for a policy that chooses decode pages."""
        import math

        from nanovllm.ops.quest_scores import COMBINES
        from nanovllm.sparse import policy_class, policy_names
        from nanovllm.sparse.choosing import PAGE_SIZES

        try:
            policy_class(self.sparse_policy)
        except ValueError:
            raise ValueError(f"sparse-policy must be one of {policy_names()}, "
                             f"got {self.sparse_policy!r}") from None
        if self.sparse_page_size not in PAGE_SIZES or self.block_size % self.sparse_page_size:
            raise ValueError(f"sparse-page-size must be one of {list(PAGE_SIZES)} and divide block-size="
                             f"{self.block_size}, got {self.sparse_page_size!r}")
        if self.sparse_topk_blocks is not None:
            if _not_int(self.sparse_topk_blocks) or self.sparse_topk_blocks < 1:
                raise ValueError(f"sparse-topk-blocks must be >= 1, got {self.sparse_topk_blocks!r}")
            if self.sparse_token_budget != DEFAULT_TOKEN_BUDGET:
                raise ValueError(f"sparse-topk-blocks={self.sparse_topk_blocks} (deprecated) and sparse-token-budget="
                                 f"{self.sparse_token_budget} both set the budget; give --sparse-token-budget only")
        if _not_int(self.sparse_token_budget) or self.sparse_token_budget < 1:
            raise ValueError(f"sparse-token-budget must be an integer >= 1, got {self.sparse_token_budget!r}")
        chooses = policy_class(self.sparse_policy).chooses_decode_pages
        for name in ("sparse_sink_tokens", "sparse_recent_tokens"):
            value = getattr(self, name)
            if _not_int(value) or value < 0 or (chooses and value > self.max_model_len):
                raise ValueError(f"{name.replace('_', '-')} must be an integer in [0, {self.max_model_len}] "
                                 f"(input-len + max-new-tokens), got {value!r}")
        if _not_int(self.sparse_dense_layers) or self.sparse_dense_layers < 0:
            raise ValueError(f"sparse-dense-layers must be an integer >= 0, got {self.sparse_dense_layers!r}")
        if self.sparse_group_score not in COMBINES:
            raise ValueError(f"sparse-group-score must be one of {list(COMBINES)}, got {self.sparse_group_score!r}")
        if not (isinstance(self.sparse_radius_weight, (int, float)) and 0.0 <= self.sparse_radius_weight <= 1.0):
            raise ValueError(f"sparse-radius-weight must be in [0, 1], got {self.sparse_radius_weight!r}")
        if not (isinstance(self.sparse_threshold, (int, float)) and math.isfinite(self.sparse_threshold)
                and 0.0 <= self.sparse_threshold <= 1.0):
            raise ValueError(f"sparse-threshold must be in [0, 1], got {self.sparse_threshold!r}")
        if self.sparse_stride < 1 or self.sparse_stride & (self.sparse_stride - 1) or self.sparse_stride > 64:
            raise ValueError(f"sparse-stride must be a power of two in [1, 64], got {self.sparse_stride}")
        if self.num_reuse_cache_blocks is not None:
            if _not_int(self.num_reuse_cache_blocks) or self.num_reuse_cache_blocks < -1:
                raise ValueError(f"num-reuse-cache-blocks must be -1 (the engine's default) or >= 0, "
                                 f"got {self.num_reuse_cache_blocks!r}")
            if self.num_reuse_cache_blocks > 0 and not (self.enable_offload and chooses):
                from nanovllm.sparse import choosing_policy_names

                raise ValueError(f"num-reuse-cache-blocks={self.num_reuse_cache_blocks} needs --enable-offload and "
                                 f"--sparse-policy {' or '.join(choosing_policy_names())}")

    def engine_kwargs(self, max_model_len: int | None = None, max_num_seqs: int = 1) -> dict:
        """Keyword arguments of :class:`nanovllm.LLM` (``max_model_len`` defaults to the
        settings' own)."""
        if max_model_len is None:
            max_model_len = self.max_model_len
        kw = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, device=self.device,
                  dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, enforce_eager=self.enforce_eager,
                  kvcache_block_size=self.block_size,
                  sparse_policy=self.sparse_policy, sparse_page_size=self.sparse_page_size,
                  sparse_token_budget=self.sparse_token_budget, sparse_sink_tokens=self.sparse_sink_tokens,
                  sparse_recent_tokens=self.sparse_recent_tokens, sparse_dense_layers=self.sparse_dense_layers,
                  sparse_group_score=self.sparse_group_score, sparse_radius_weight=self.sparse_radius_weight,
                  sparse_layer_budget_weights=self.sparse_layer_budget_weights,
                  sparse_threshold=self.sparse_threshold, sparse_stride=self.sparse_stride)
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.sparse_topk_blocks is not None:  # the engine turns it into the token budget (and warns)
            kw["sparse_topk_blocks"] = self.sparse_topk_blocks
        if self.enable_offload:
            per_seq = -(-max_model_len // self.block_size)
            kw.update(enable_cpu_offload=True,
                      num_kvcache_blocks=(self.num_gpu_kv_blocks if self.num_gpu_kv_blocks is not None
                                          else 2 * max_num_seqs),
                      num_cpu_kvcache_blocks=(self.num_cpu_blocks if self.num_cpu_blocks is not None
                                              else per_seq * max_num_seqs))
            if self.num_ring_slots is not None:
                kw.update(num_ring_slots=self.num_ring_slots)
            if self.num_reuse_cache_blocks is not None:
                kw.update(num_reuse_cache_blocks=self.num_reuse_cache_blocks)
        return kw


def _weights(text: str) -> tuple[float, ...]:
    """``--sparse-layer-budget-weights``: comma-separated numbers."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def add_engine_arguments(parser: argparse.ArgumentParser, num_cpu_blocks_help: str,
                         before_device=None) -> None:
    """The command-line options of :class:`EngineSettings`' fields. ``before_device`` (a callable
    taking the parser) adds options that belong between the offload ones and ``--device``."""
    p = parser
    p.add_argument("--enable-offload", action="store_true",
                   help="the host tier of the KV cache (enable_cpu_offload=True)")
    p.add_argument("--num-ring-slots", type=int, default=None,
                   help="host tier: ring-buffer slots (default: the engine's, sized to 128 MiB)")
    p.add_argument("--num-gpu-kv-blocks", type=int, default=None,
                   help="host tier: GPU-tier blocks (default: 2 per sequence, so the host tier holds the rest)")
    p.add_argument("--block-size", type=int, default=1024,
                   help="KV block in tokens (both tiers), a multiple of 256 (default 1024)")
    p.add_argument("--num-cpu-blocks", type=int, default=None, help=num_cpu_blocks_help)
    p.add_argument("--sparse-policy", default="FULL", type=str.upper,
                   help=f"sparse policy, one of {', '.join(_policy_names())}: QUEST (decode: pages chosen per KV "
                        "head by key bounds), STREAMING (decode: sinks and a recent window), XATTN_BSA (prefill) "
                        "(default FULL)")
    d = {f.name: f.default for f in fields(EngineSettings)}
    p.add_argument("--sparse-page-size", type=int, default=d["sparse_page_size"],
                   help=f"QUEST / STREAMING: tokens per page, 16, 32 or 64, dividing --block-size "
                        f"(default {d['sparse_page_size']})")
    p.add_argument("--sparse-token-budget", type=int, default=d["sparse_token_budget"],
                   help=f"QUEST: tokens each KV head picks per decode step besides the always-read ones, "
                        f"whole pages (default {d['sparse_token_budget']})")
    p.add_argument("--sparse-sink-tokens", type=int, default=d["sparse_sink_tokens"],
                   help=f"QUEST / STREAMING: first tokens every decode step reads (default {d['sparse_sink_tokens']})")
    p.add_argument("--sparse-recent-tokens", type=int, default=d["sparse_recent_tokens"],
                   help=f"QUEST / STREAMING: last tokens every decode step reads (default "
                        f"{d['sparse_recent_tokens']})")
    p.add_argument("--sparse-dense-layers", type=int, default=d["sparse_dense_layers"],
                   help=f"QUEST / STREAMING: the first layers read every page (default {d['sparse_dense_layers']})")
    p.add_argument("--sparse-group-score", default=d["sparse_group_score"],
                   help=f"QUEST: how a KV head combines its query heads' page shares, max or sum "
                        f"(default {d['sparse_group_score']})")
    p.add_argument("--sparse-radius-weight", type=float, default=d["sparse_radius_weight"],
                   help=f"QUEST: weight of a page's key radius in its score, in [0, 1]: 1.0 Quest's bound, 0.0 "
                        f"the key box's center (default {d['sparse_radius_weight']})")
    p.add_argument("--sparse-layer-budget-weights", type=_weights, default=None,
                   help="QUEST: comma-separated weights, one per layer: layer l reads --sparse-token-budget x "
                        "w[l] / mean(w) (fitted by python -m benchmarks.layer_budgets; default: the same at every layer)")
    p.add_argument("--sparse-topk-blocks", type=int, default=None,
                   help="deprecated: --sparse-token-budget = this x --block-size")
    p.add_argument("--num-reuse-cache-blocks", type=int, default=None,
                   help="host tier with QUEST / STREAMING: GPU blocks per layer of the reuse cache (0: none; "
                        "default: the engine's)")
    p.add_argument("--sparse-threshold", type=float, default=0.97,
                   help="XATTN_BSA: share of the estimated attention mass kept per query block, in [0, 1] "
                        "(default 0.97)")
    p.add_argument("--sparse-stride", type=int, default=8,
                   help="XATTN_BSA: antidiagonal stride of the block estimate, a power of two in [1, 64] "
                        "(default 8)")
    if before_device is not None:
        before_device(p)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: the model's dtype on GPU, float32 on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=_kv_cache_dtypes(),
                   help="the KV cache's storage dtype (auto: the compute dtype; fp8 = fp8_e4m3)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the GPU this process may use (default: the engine's)")


def _kv_cache_dtypes() -> list[str]:
    from nanovllm.utils.dtypes import KV_CACHE_DTYPES

    return list(KV_CACHE_DTYPES)


def _policy_names() -> list[str]:
    from nanovllm.sparse import policy_names

    return policy_names()


def engine_fields(args: argparse.Namespace) -> dict:
    """:class:`EngineSettings`' fields from parsed :func:`add_engine_arguments` options."""
    kw = {name: getattr(args, name) for name in ENGINE_FIELDS}
    kw["dtype"] = None if args.dtype == "auto" else args.dtype
    return kw


def resolve_model_dir(parser: argparse.ArgumentParser, model: str | None, max_model_len: int) -> str:
    """``model`` (default: SmolLM2 via :func:`nanovllm.fetch.fetch_model`), checked to be a model
    directory whose ``max_position_embeddings`` holds ``max_model_len`` (``parser.error``
    otherwise), before paying for the engine."""
    from pathlib import Path

    from transformers import AutoConfig

    if model is None:
        from nanovllm.fetch import fetch_model

        model_dir = fetch_model()
    else:
        model_dir = model
        if not (Path(model_dir) / "config.json").is_file():
            parser.error(f"--model {model_dir}: not a model directory (no config.json)")
    limit = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    if max_model_len > limit:
        parser.error(f"--input-len + --max-new-tokens = {max_model_len} exceeds the "
                     f"model's max_position_embeddings={limit}")
    return model_dir


def make_llm(model_dir: str, settings: EngineSettings):
    """An :class:`nanovllm.LLM` able to run ``settings`` (validated first)."""
    from nanovllm import LLM

    settings.validate()
    return LLM(model_dir, **settings.engine_kwargs())


def engine_offload(llm) -> dict | None:
    """The host-tier settings the engine actually runs with (None: no host tier)."""
    cfg = llm.config
    if not cfg.enable_cpu_offload:
        return None
    stats = llm.get_kv_cache_stats()
    return dict(block_size=cfg.kvcache_block_size, num_ring_slots=stats["ring_slots"],
                gpu_blocks=stats["gpu_blocks"], host_blocks=stats["host_blocks"],
                sparse_policy=getattr(cfg.sparse_policy, "value", str(cfg.sparse_policy)))


def tier_moves(llm) -> tuple[int, int] | None:
    """``(loaded_blocks, spilled_blocks)`` so far (None without a host tier)."""
    if not llm.config.enable_cpu_offload:
        return None
    stats = llm.get_kv_cache_stats()
    return stats["loaded_blocks"], stats["spilled_blocks"]


def sparse_options(llm) -> dict:
    """The engine options its sparse policy reads (the policy's declared ``options``), as the
    engine runs them (a deprecated ``sparse_topk_blocks`` already turned into the token budget)."""
    from nanovllm.sparse import policy_class

    cfg = llm.config
    return {name: getattr(cfg, name) for name in policy_class(cfg.sparse_policy).options}


def sparse_stats_text(stats: dict | None, options: dict | None = None) -> str:
    """One line of :meth:`nanovllm.LLM.get_sparse_stats`: the policy (with ``options``, from
    :func:`sparse_options`), prefill compute and communication density, decode density (share of
    the KV read per KV head), communication density and reuse rate ("-" where nothing was
    counted)."""
    if stats is None:
        return "-"

    def fmt(value):
        return "-" if value is None else f"{value:.3f}"

    prefill, decode = stats["prefill"], stats["decode"]
    policy = stats["policy"]
    if options:
        policy += " (" + ", ".join(f"{name.removeprefix('sparse_')}={value}" for name, value in options.items()) + ")"
    text = (f"{policy}: prefill density {fmt(prefill['density'])}, comm density "
            f"{fmt(prefill['comm_density'])}; decode density {fmt(decode.get('density'))}, comm density "
            f"{fmt(decode['comm_density'])}")
    if decode.get("reuse_rate") is not None:
        text += f", reuse rate {fmt(decode['reuse_rate'])}"
    return text
