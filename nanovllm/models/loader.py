"""Loads safetensors checkpoints (single file or sharded with an index) into a model."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.attention import Attention

KV_SCALE_NAMES = ("k_scale", "v_scale")
"""Checkpoint tensors of a layer's static fp8 KV scales (vLLM's names), each one float:
``model.layers.N.self_attn.k_scale``, also under ``self_attn.attn.`` or ``self_attn.k_proj.`` /
``self_attn.v_proj.``."""


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    param.data.copy_(loaded)


def _target(name: str, packed: dict) -> tuple[str, object]:
    for key, (packed_name, shard_id) in packed.items():
        if f".{key}." in name:
            return name.replace(key, packed_name), shard_id
    return name, None


def load_model(model: nn.Module, path: str):
    """Copy every tensor of ``path/*.safetensors`` into ``model``'s parameters.

    Packed parameters (``qkv_proj``, ``gate_up_proj``) are filled either from separate checkpoint
    tensors through ``model.packed_modules_mapping`` (``q_proj`` -> shard ``"q"`` of ``qkv_proj``,
    ...), or from one fused checkpoint tensor of the packed parameter's own name (Phi-3's
    ``qkv_proj``, GLM's and Phi-3's ``gate_up_proj``: the shards concatenated in order), which the
    parameter's ``weight_loader`` splits into its shards. Either way the ``weight_loader`` takes
    this rank's slice of each shard (its heads, its rows). A tied ``lm_head.weight`` in the
    checkpoint is skipped. A layer's ``k_scale`` and ``v_scale`` (:data:`KV_SCALE_NAMES`) become its
    attention's ``static_kv_scales`` (used by an fp8 KV cache, ignored by another).

    Raises:
        RuntimeError: no safetensors file, an unreadable file, a checkpoint tensor with no
            matching parameter or of the wrong shape, or a parameter that no checkpoint tensor
            filled (naming them); a KV scale that is not one positive finite number, or a layer
            with only one of the two.
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise RuntimeError(f"no *.safetensors weights in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    unfilled = {name for name, p in model.named_parameters()}
    kv_scales: dict[str, dict[str, float]] = {}
    for file in files:
        try:
            handle = safe_open(file, "pt", "cpu")
        except Exception as err:  # safetensors raises its own error types
            raise RuntimeError(f"cannot read weights file {file!r}: {err}") from err
        with handle as f:
            for name in f.keys():
                if name.rpartition(".")[2] in KV_SCALE_NAMES:
                    _note_kv_scale(kv_scales, name, f.get_tensor(name))
                    continue
                target, shard_id = _target(name, packed)
                if target not in params:
                    if name == "lm_head.weight" or "rotary_emb.inv_freq" in name:
                        continue
                    raise RuntimeError(f"checkpoint tensor {name!r} has no parameter in the model")
                _load_one(params[target], f.get_tensor(name), shard_id, name, target, file)
                unfilled.discard(target)
    if unfilled:
        raise RuntimeError(f"parameters missing from the checkpoint: {sorted(unfilled)[:8]}")
    _set_kv_scales(model, kv_scales)


def _note_kv_scale(kv_scales: dict, name: str, tensor: torch.Tensor):
    """Record checkpoint scale ``name`` under its layer's attention module name."""
    prefix, _, which = name.rpartition(".")
    for inner in (".attn", ".k_proj", ".v_proj"):
        prefix = prefix.removesuffix(inner)
    value = tensor.float().flatten()
    if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
        raise RuntimeError(f"checkpoint KV scale {name!r} must be one positive finite number; got {list(tensor.shape)} "
                           f"{value[:4].tolist()}")
    kv_scales.setdefault(f"{prefix}.attn", {})[which] = value.item()


def _set_kv_scales(model: nn.Module, kv_scales: dict):
    for module_name, scales in kv_scales.items():
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        if not isinstance(module, Attention):
            raise RuntimeError(f"checkpoint KV scales {sorted(scales)} of {module_name!r} have no attention layer")
        if len(scales) != len(KV_SCALE_NAMES):
            raise RuntimeError(f"{module_name!r}: the checkpoint has {sorted(scales)} but not both of {KV_SCALE_NAMES}")
        module.static_kv_scales = (scales["k_scale"], scales["v_scale"])


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str, target: str, file: str):
    loader = getattr(param, "weight_loader", _default_weight_loader)
    try:
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"checkpoint tensor {name!r} {list(tensor.shape)} in {os.path.basename(file)} "
                           f"does not fit parameter {target!r} {list(param.shape)}: {err}") from err
