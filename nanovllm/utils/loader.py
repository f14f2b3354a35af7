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

    Packed parameters (qkv, gate_up) are filled through ``model.packed_modules_mapping``; each
    parameter's ``weight_loader`` takes this rank's shard. A tied ``lm_head.weight`` in the
    checkpoint is skipped.

    Raises:
        RuntimeError: no safetensors file, a checkpoint tensor with no matching parameter, or a
            parameter that no checkpoint tensor filled (naming them).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise RuntimeError(f"no *.safetensors weights in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    unfilled = {name for name, p in model.named_parameters()}
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                target, shard_id = _target(name, packed)
                if target not in params:
                    if name == "lm_head.weight" or "rotary_emb.inv_freq" in name:
                        continue
                    raise RuntimeError(f"checkpoint tensor {name!r} has no parameter in the model")
                param = params[target]
                loader = getattr(param, "weight_loader", _default_weight_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
                unfilled.discard(target)
    if unfilled:
        raise RuntimeError(f"parameters missing from the checkpoint: {sorted(unfilled)[:8]}")
