"""Supported architectures; importing this package registers them."""
from nanovllm.models import decoder, glm, phi3  # noqa: F401  (register the classes)
from nanovllm.models.registry import get_model_class, register_model, supported_architectures

__all__ = ["get_model_class", "register_model", "supported_architectures"]
