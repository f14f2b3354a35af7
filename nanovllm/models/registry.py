"""Model classes keyed by the ``architectures`` entry of an HF config."""
from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


def register_model(*architectures: str):
    """Class decorator: ``@register_model("LlamaForCausalLM")``."""
    def wrap(cls):
        for name in architectures:
            _MODELS[name] = cls
        return cls
    return wrap


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type[nn.Module]:
    """The registered class for ``hf_config.architectures[0]``.

    Raises:
        ValueError: the architecture is not registered; the message lists the supported ones.
    """
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"unsupported architecture {archs!r}; supported: {supported_architectures()}")
