"""Loads safetensors checkpoints (single file or sharded with an index) into a model."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


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
    checkpoint is skipped.

    Raises:
        RuntimeError: no safetensors file, an unreadable file, a checkpoint tensor with no
            matching parameter or of the wrong shape, or a parameter that no checkpoint tensor
            filled (naming them).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise RuntimeError(f"no *.safetensors weights in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    unfilled = {name for name, p in model.named_parameters()}
    for file in files:
        try:
            handle = safe_open(file, "pt", "cpu")
        except Exception as err:  # safetensors raises its own error types
            raise RuntimeError(f"cannot read weights file {file!r}: {err}") from err
        with handle as f:
            for name in f.keys():
                target, shard_id = _target(name, packed)
                if target not in params:
                    if name == "lm_head.weight" or "rotary_emb.inv_freq" in name:
                        continue
                    raise RuntimeError(f"checkpoint tensor {name!r} has no parameter in the model")
                _load_one(params[target], f.get_tensor(name), shard_id, name, target, file)
                unfilled.discard(target)
    if unfilled:
        raise RuntimeError(f"parameters missing from the checkpoint: {sorted(unfilled)[:8]}")


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str, target: str, file: str):
    loader = getattr(param, "weight_loader", _default_weight_loader)
    try:
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"checkpoint tensor {name!r} {list(tensor.shape)} in {os.path.basename(file)} "
                           f"does not fit parameter {target!r} {list(param.shape)}: {err}") from err
