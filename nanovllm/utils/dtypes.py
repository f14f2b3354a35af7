"""The engine's dtype names: the model's (``dtype``, vLLM's aliases included) and the KV cache's
(``kv_cache_dtype``, vLLM's names), each resolved to a torch dtype once, by ``Config``."""
import torch
from transformers import PretrainedConfig

MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float": torch.float32, "half": torch.float16}
"""``dtype`` names, vLLM's aliases ("float", "half") included."""
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
"""``kv_cache_dtype`` names (vLLM's): "auto" stores the model's dtype; "fp8" is "fp8_e4m3"."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The 8-bit float formats the KV cache stores (with per-(token, KV head) scales)."""


def resolve_model_dtype(dtype, hf_config: PretrainedConfig, device: str) -> torch.dtype:
    """The model's compute dtype: ``dtype`` (a name of :data:`MODEL_DTYPES` or one of its torch
    dtypes), or for None / "auto" float32 on CPU and on CUDA the checkpoint's (bfloat16 if it
    names none of ours).

    Raises:
        ValueError: any other value, naming the choices.
    """
    if dtype is None or dtype == "auto":  # "auto": vLLM's name for the default
        if device == "cpu":
            return torch.float32
        model_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = MODEL_DTYPES.get(model_dtype, torch.bfloat16)
        return model_dtype if model_dtype in MODEL_DTYPES.values() else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in MODEL_DTYPES.values():
        return dtype
    if dtype in MODEL_DTYPES:
        return MODEL_DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(MODEL_DTYPES)}, 'auto' or None, got {dtype!r}")


def resolve_kv_cache_dtype(kv_cache_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores: ``model_dtype`` for "auto", else the fp8 format named.

    Raises:
        ValueError: a value not in :data:`KV_CACHE_DTYPES`, naming the option, the value and the
            choices.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(repr(n) for n in KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


FP8_E4M3_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability below which Triton has no float8_e4m3fn (its ``fp8e4nv``; Ada, Hopper
and later have it). Triton's NVIDIA backend supports float8_e5m2 (``fp8e5``) at every capability."""


def check_kv_cache_device(kv_cache_dtype: str, cache_dtype: torch.dtype, device_indices) -> None:
    """Refuse a cache dtype that the Triton kernels cannot compile for a CUDA device the engine uses.

    Args:
        kv_cache_dtype: the option's value (for the message).
        cache_dtype: the dtype it resolved to (:func:`resolve_kv_cache_dtype`).
        device_indices: the CUDA device indices of this process's ranks.

    Raises:
        ValueError: float8_e4m3fn on a device of compute capability below
            :data:`FP8_E4M3_MIN_CAPABILITY`, naming the option, the value, the device, its
            capability and the limit, and suggesting "fp8_e5m2".
    """
    if cache_dtype != torch.float8_e4m3fn:
        return
    for index in device_indices:
        capability = tuple(torch.cuda.get_device_capability(index))
        if capability < FP8_E4M3_MIN_CAPABILITY:
            limit = "%d.%d" % FP8_E4M3_MIN_CAPABILITY
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} stores torch.float8_e4m3fn, which the Triton kernels need compute "
                f"capability >= {limit} for; cuda:{index} ({torch.cuda.get_device_name(index)}) has "
                f"{capability[0]}.{capability[1]}: use kv_cache_dtype='fp8_e5m2' (Triton supports float8_e5m2 "
                f"below {limit}) or 'auto'")
