"""vLLM's ``LLM(...)`` arguments that are not fields of :class:`nanovllm.config.Config`: the
values this engine takes as a no-op (vLLM's defaults, and values that change nothing here), and
what a value asking for behaviour this engine lacks is refused with. Also :class:`ModelConfig`,
the read-only view of the engine's model settings that vLLM scripts and lm-eval read as
``llm.llm_engine.model_config``.

A vLLM argument that is a Config field (``kv_cache_dtype``, ``max_model_len``, ...) is not listed
here; were one listed too, the Config field's check would decide: :func:`check_vllm_args` leaves
Config fields alone.
"""
from dataclasses import dataclass
from numbers import Real
from typing import Callable

from nanovllm.utils.checks import is_integer


@dataclass(frozen=True)
class VllmArg:
    """One vLLM argument: ``accepts(value)`` says whether ``value`` is a no-op here; ``accepted``
    says which values those are, ``instead`` what this engine does or offers in its place."""

    accepts: Callable[[object], bool]
    accepted: str
    instead: str


def _same(value, choice) -> bool:
    return type(value) is type(choice) and value == choice if choice is not None else value is None


def _one_of(*choices) -> Callable[[object], bool]:
    """Exactly one of ``choices`` (True is not 1, "none" is not None)."""
    return lambda value: any(_same(value, c) for c in choices)


def _empty(value) -> bool:
    """None or an empty dict / list / tuple / string (vLLM's "not set")."""
    return value is None or (isinstance(value, (dict, list, tuple, str)) and len(value) == 0)


def _any_bool(value) -> bool:
    return isinstance(value, bool)


def _any(value) -> bool:
    return True


def _number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value >= 0


def _integer(value) -> bool:
    return is_integer(value)


def _arg(accepts, accepted: str, instead: str) -> VllmArg:
    return VllmArg(accepts, accepted, instead)


_NONE = "None"
_NO_MM = "no multi-modal models here"
_NO_LORA = "no LoRA adapters here"
_NO_EP = "no mixture-of-experts models here"
_NO_PP = "tensor_parallel_size and data_parallel_size are the parallelism here"
_NOOP = "any value: nothing here depends on it"

VLLM_ARGS: dict[str, VllmArg] = {
    # ---- model and tokenizer
    "runner": _arg(_one_of("auto", "generate"), "'auto', 'generate'", "nanovllm runs generative models only"),
    "convert": _arg(_one_of("auto", "none"), "'auto', 'none'", "nanovllm runs generative models only"),
    "task": _arg(_one_of(None, "auto", "generate"), "None, 'auto', 'generate'", "nanovllm runs generative models only"),
    "tokenizer_mode": _arg(_one_of("auto", "hf"), "'auto', 'hf'",
                           "the tokenizer is transformers' AutoTokenizer (fast where the model has one)"),
    "skip_tokenizer_init": _arg(_one_of(False), "False", "the engine always loads the tokenizer"),
    "allowed_local_media_path": _arg(_empty, "''", _NO_MM),
    "allowed_media_domains": _arg(_empty, _NONE, _NO_MM),
    "served_model_name": _arg(_any, _NOOP + " (a server's name for the model)", ""),
    "hf_config_path": _arg(_empty, _NONE, "config.json is read from the model directory"),
    "code_revision": _arg(_empty, _NONE, "the model runs nanovllm's own code"),
    "config_format": _arg(_one_of("auto", "hf"), "'auto', 'hf'", "config.json in Hugging Face's format"),
    "enable_prompt_embeds": _arg(_one_of(False), "False", "prompts are text or token ids"),
    "load_format": _arg(_one_of("auto", "safetensors"), "'auto', 'safetensors'", "weights load from safetensors"),
    "safetensors_load_strategy": _arg(_one_of("lazy", "eager"), "'lazy', 'eager'", "weights load from safetensors"),
    "model_loader_extra_config": _arg(_empty, "None, {}", "weights load from safetensors"),
    "ignore_patterns": _arg(_any, _NOOP + " (a Hub download fetches only safetensors, config and tokenizer files)",
                            ""),
    "use_tqdm_on_load": _arg(_any_bool, "True, False (no-op)", ""),
    "pt_load_map_location": _arg(_one_of("cpu"), "'cpu'", "weights load from safetensors"),
    "quantization": _arg(_empty, _NONE, "quantized weights are not supported (GGUF is dequantized when fetched)"),
    "hf_token": _arg(_one_of(None, True), "None, True (huggingface_hub's stored token or HF_TOKEN)",
                     "set HF_TOKEN in the environment"),
    "hf_overrides": _arg(_empty, "None, {}", "edit the model's config.json"),
    "rope_scaling": _arg(_empty, "None, {}", "RoPE scaling comes from the model's config.json"),
    "rope_theta": _arg(_empty, _NONE, "rope_theta comes from the model's config.json"),
    "model_impl": _arg(_one_of("auto", "vllm"), "'auto', 'vllm' (the engine's own implementation)",
                       "the model runs nanovllm's own code"),
    "override_attention_dtype": _arg(_empty, _NONE, "attention runs in the model's dtype"),
    "logprobs_mode": _arg(_one_of("raw_logprobs"), "'raw_logprobs'",
                          "logprobs are the model's raw distribution (before penalties and temperature)"),
    "generation_config": _arg(_one_of("auto", "vllm"), "'auto', 'vllm'",
                              "the model directory's generation_config.json (see get_default_sampling_params)"),
    "override_generation_config": _arg(_empty, "None, {}", "pass SamplingParams to generate()"),
    "logits_processor_pattern": _arg(_empty, _NONE, "custom logits processors are not supported"),
    "logits_processors": _arg(_empty, "None, []", "custom logits processors are not supported"),
    "io_processor_plugin": _arg(_empty, _NONE, "no IO processor plugins here"),
    "pooler_config": _arg(_empty, _NONE, "nanovllm runs generative models only"),
    "override_pooler_config": _arg(_empty, _NONE, "nanovllm runs generative models only"),
    "disable_sliding_window": _arg(_one_of(False), "False",
                                   "a model's sliding window is always applied (vLLM's True attends to the whole context)"),
    "disable_cascade_attn": _arg(_any_bool, "True, False (no-op: no cascade attention here)", ""),
    "enable_sleep_mode": _arg(_one_of(False), "False", "use shutdown() to free the GPU"),
    "enable_return_routed_experts": _arg(_one_of(False), "False", _NO_EP),
    "reasoning_parser": _arg(_empty, "''", "no reasoning parsers here (offline generation returns the text)"),
    # ---- parallelism and launch
    "distributed_executor_backend": _arg(_one_of(None, "mp", "uni", "external_launcher"),
                                         "None, 'mp', 'uni', 'external_launcher'",
                                         "ranks are spawned on this host, or launched by torchrun (read from the "
                                         "environment); Ray is not supported"),
    "pipeline_parallel_size": _arg(_one_of(1), "1", _NO_PP),
    "decode_context_parallel_size": _arg(_one_of(1), "1", _NO_PP),
    "data_parallel_rank": _arg(_empty, _NONE, "data-parallel ranks come from torchrun's environment"),
    "data_parallel_start_rank": _arg(_empty, _NONE, "data-parallel ranks come from torchrun's environment"),
    "data_parallel_size_local": _arg(_empty, _NONE, "data-parallel ranks come from torchrun's environment"),
    "data_parallel_address": _arg(_empty, _NONE, "data-parallel ranks come from torchrun's environment"),
    "data_parallel_rpc_port": _arg(_empty, _NONE, "data-parallel ranks come from torchrun's environment"),
    "data_parallel_hybrid_lb": _arg(_one_of(False), "False", "data_parallel_size splits every generate()"),
    "data_parallel_backend": _arg(_one_of("mp"), "'mp'", "replicas are processes on this host or torchrun ranks"),
    "enable_expert_parallel": _arg(_one_of(False), "False", _NO_EP),
    "all2all_backend": _arg(_any, _NOOP + " (" + _NO_EP + ")", ""),
    "enable_dbo": _arg(_one_of(False), "False", "no dual-batch overlap here"),
    "dbo_decode_token_threshold": _arg(_integer, "an integer (no-op without enable_dbo)", ""),
    "dbo_prefill_token_threshold": _arg(_integer, "an integer (no-op without enable_dbo)", ""),
    "disable_nccl_for_dp_synchronization": _arg(_any_bool, "True, False (no-op)", ""),
    "eplb_config": _arg(_empty, "None, {}", _NO_EP),
    "enable_eplb": _arg(_one_of(False), "False", _NO_EP),
    "expert_placement_strategy": _arg(_one_of("linear"), "'linear'", _NO_EP),
    "num_redundant_experts": _arg(_one_of(0), "0", _NO_EP),
    "eplb_window_size": _arg(_integer, "an integer (no-op without enable_eplb)", ""),
    "eplb_step_interval": _arg(_integer, "an integer (no-op without enable_eplb)", ""),
    "eplb_log_balancedness": _arg(_any_bool, "True, False (no-op without enable_eplb)", ""),
    "max_parallel_loading_workers": _arg(lambda v: v is None or is_integer(v), "None or an integer (no-op)", ""),
    "disable_custom_all_reduce": _arg(_any_bool, "True, False (no-op: NCCL's all-reduce)", ""),
    "ray_workers_use_nsight": _arg(_one_of(False), "False", "Ray is not supported"),
    "worker_cls": _arg(_one_of("auto"), "'auto'", "the workers run nanovllm's ModelRunner"),
    "worker_extension_cls": _arg(_empty, "''", "the workers run nanovllm's ModelRunner"),
    # ---- KV cache and memory
    "block_size": _arg(_empty, _NONE, "the KV block is kvcache_block_size (tokens, a multiple of 256)"),
    "kv_cache_memory_bytes": _arg(_empty, _NONE,
                                  "the GPU tier is sized by gpu_memory_utilization or num_kvcache_blocks"),
    "num_gpu_blocks_override": _arg(_empty, _NONE, "the GPU tier's size is num_kvcache_blocks (blocks of "
                                                   "kvcache_block_size tokens)"),
    "swap_space": _arg(_number, "a number >= 0 (no-op, as in vLLM V1)",
                       "the host tier of the KV cache is enable_cpu_offload=True with num_cpu_kvcache_blocks or "
                       "cpu_memory_utilization"),
    "cpu_offload_gb": _arg(_one_of(0, 0.0), "0", "weights stay on the GPU; the KV cache's host tier is "
                                                 "enable_cpu_offload=True"),
    "prefix_caching_hash_algo": _arg(_one_of("sha256", "sha256_cbor", "builtin", "xxhash", "xxhash_cbor"),
                                     "vLLM's names (no-op: a block matches by xxh64 and by its token ids)", ""),
    "calculate_kv_scales": _arg(_one_of(False), "False", "fp8 KV scales are computed per (token, KV head) at every store, or read from the checkpoint"),
    "mamba_cache_dtype": _arg(_one_of("auto"), "'auto'", "no state-space models here"),
    "mamba_ssm_cache_dtype": _arg(_one_of("auto"), "'auto'", "no state-space models here"),
    "mamba_block_size": _arg(_empty, _NONE, "no state-space models here"),
    "kv_sharing_fast_prefill": _arg(_one_of(False), "False", "no cross-layer KV sharing here"),
    "kv_transfer_config": _arg(_empty, _NONE, "no disaggregated prefill here"),
    "kv_events_config": _arg(_empty, _NONE, "no KV-cache events here"),
    # ---- scheduling and execution
    "enable_chunked_prefill": _arg(_one_of(None, True), "None, True",
                                   "chunked prefill is always on; max_num_batched_tokens sets the chunk"),
    "max_num_partial_prefills": _arg(_one_of(1), "1", "one prompt is part-way through prefill at a time"),
    "max_long_partial_prefills": _arg(_one_of(1), "1", "one prompt is part-way through prefill at a time"),
    "long_prefill_token_threshold": _arg(_one_of(0), "0", "max_num_batched_tokens sets the chunk"),
    "num_lookahead_slots": _arg(_one_of(0), "0", "no speculative decoding here"),
    "disable_chunked_mm_input": _arg(_any_bool, "True, False (no-op: " + _NO_MM + ")", ""),
    "disable_hybrid_kv_cache_manager": _arg(_any_bool, "True, False (no-op: one KV spec for every layer)", ""),
    "scheduling_policy": _arg(_one_of("fcfs"), "'fcfs'", "requests are scheduled first come, first served"),
    "scheduler_cls": _arg(_empty, _NONE, "the engine's own scheduler"),
    "cuda_graph_sizes": _arg(_empty, _NONE, "decode graphs are captured for every batch size up to max_num_seqs"),
    "cudagraph_capture_sizes": _arg(_empty, _NONE,
                                    "decode graphs are captured for every batch size up to max_num_seqs"),
    "max_cudagraph_capture_size": _arg(_empty, _NONE, "max_num_seqs is the largest decode graph"),
    "max_seq_len_to_capture": _arg(_integer, "an integer (no-op: decode graphs cover every length)", ""),
    "compilation_config": _arg(lambda v: _empty(v) or _same(v, 0), "None, {}, 0",
                               "decode runs CUDA graphs (enforce_eager=True turns them off); no torch.compile"),
    "attention_config": _arg(_empty, "None, {}", "attention uses the engine's own kernels"),
    "structured_outputs_config": _arg(_empty, "None, {}", "structured outputs are not supported"),
    "profiler_config": _arg(_empty, "None, {}", "profile with torch.profiler around generate()"),
    "speculative_config": _arg(_empty, _NONE, "no speculative decoding here"),
    "guided_decoding_backend": _arg(_empty, _NONE, "guided decoding is not supported"),
    "guided_decoding_disable_fallback": _arg(_empty, _NONE, "guided decoding is not supported"),
    "guided_decoding_disable_any_whitespace": _arg(_empty, _NONE, "guided decoding is not supported"),
    "guided_decoding_disable_additional_properties": _arg(_empty, _NONE, "guided decoding is not supported"),
    "additional_config": _arg(_empty, "None, {}", "platform plugins are not supported"),
    "disable_async_output_proc": _arg(_any_bool, "True, False (no-op)", ""),
    # ---- statistics and observability
    "disable_log_stats": _arg(_any_bool, "True, False (no-op: no periodic statistics log)", ""),
    "aggregate_engine_logging": _arg(_any_bool, "True, False (no-op)", ""),
    "show_hidden_metrics_for_version": _arg(_empty, _NONE, "no Prometheus metrics here"),
    "otlp_traces_endpoint": _arg(_empty, _NONE, "no tracing here"),
    "collect_detailed_traces": _arg(_empty, _NONE, "no tracing here"),
    # ---- multi-modal
    "limit_mm_per_prompt": _arg(_empty, "None, {}", _NO_MM),
    "enable_mm_embeds": _arg(_one_of(False), "False", _NO_MM),
    "interleave_mm_strings": _arg(_one_of(False), "False", _NO_MM),
    "media_io_kwargs": _arg(_empty, "None, {}", _NO_MM),
    "mm_processor_kwargs": _arg(_empty, "None, {}", _NO_MM),
    "disable_mm_preprocessor_cache": _arg(_any_bool, "True, False (no-op: " + _NO_MM + ")", ""),
    "mm_processor_cache_gb": _arg(_number, "a number >= 0 (no-op: " + _NO_MM + ")", ""),
    "mm_processor_cache_type": _arg(_any, _NOOP + " (" + _NO_MM + ")", ""),
    "mm_shm_cache_max_object_size_mb": _arg(_number, "a number >= 0 (no-op: " + _NO_MM + ")", ""),
    "mm_encoder_tp_mode": _arg(_any, _NOOP + " (" + _NO_MM + ")", ""),
    "mm_encoder_attn_backend": _arg(_empty, _NONE, _NO_MM),
    "skip_mm_profiling": _arg(_any_bool, "True, False (no-op: " + _NO_MM + ")", ""),
    "video_pruning_rate": _arg(lambda v: _empty(v) or _same(v, 0.0) or _same(v, 0), "None, 0", _NO_MM),
    "enable_multimodal_encoder_data_parallel": _arg(_one_of(False), "False", _NO_MM),
    # ---- LoRA
    "enable_lora": _arg(_one_of(False), "False", _NO_LORA),
    "max_loras": _arg(_integer, "an integer (no-op without enable_lora)", ""),
    "max_lora_rank": _arg(_integer, "an integer (no-op without enable_lora)", ""),
    "default_mm_loras": _arg(_empty, _NONE, _NO_LORA),
    "fully_sharded_loras": _arg(_any_bool, "True, False (no-op without enable_lora)", ""),
    "max_cpu_loras": _arg(lambda v: v is None or is_integer(v), "None or an integer (no-op without enable_lora)",
                          ""),
    "lora_dtype": _arg(_any, _NOOP + " (without enable_lora)", ""),
    "lora_extra_vocab_size": _arg(_integer, "an integer (no-op without enable_lora)", ""),
}
"""Every vLLM ``LLM`` / ``EngineArgs`` argument that has no Config field of its own (``model``,
``tokenizer``, ``revision``, ``download_dir``, ``tokenizer_revision`` are resolved by the engine
itself)."""


def check_vllm_args(kwargs: dict, config_fields: set[str]) -> dict:
    """``kwargs`` less the vLLM arguments of :data:`VLLM_ARGS` that are not in ``config_fields``
    (each checked to be a no-op here).

    Raises:
        ValueError: a vLLM argument with a value that asks for behaviour this engine lacks, naming
            the argument, the value, the values accepted and what the engine offers instead.
    """
    rest = {}
    for name, value in kwargs.items():
        arg = VLLM_ARGS.get(name)
        if arg is None or name in config_fields:
            rest[name] = value
            continue
        if not arg.accepts(value):
            instead = f": {arg.instead}" if arg.instead else ""
            raise ValueError(f"{name}={value!r} asks for what nanovllm does not do{instead} "
                             f"(accepted values: {arg.accepted})")
    return rest


@dataclass(frozen=True)
class ModelConfig:
    """The engine's model settings, read-only, with vLLM's ``ModelConfig`` names (what lm-eval
    and vLLM scripts read as ``llm.llm_engine.model_config``).

    Attributes:
        model: the model's local directory; tokenizer: the tokenizer's directory.
        max_model_len: longest prompt + output in tokens (int).
        dtype: the torch dtype the model runs in; seed: the engine's sampling seed (int).
        hf_config: the model's transformers ``PretrainedConfig`` (also ``hf_text_config``).
        max_logprobs: the most top-k logprobs a request may ask for (-1: no limit).
    """

    model: str
    tokenizer: str
    max_model_len: int
    dtype: object
    seed: int
    hf_config: object
    trust_remote_code: bool
    tokenizer_mode: str = "auto"
    runner_type: str = "generate"
    max_logprobs: int = 20
    served_model_name: str | None = None

    @property
    def hf_text_config(self):
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_sliding_window(self):
        return None
