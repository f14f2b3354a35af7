"""FULL: every block, dense prefill (exact attention)."""
from nanovllm.sparse.policy import SparsePolicy, register_policy


@register_policy
class FullAttentionPolicy(SparsePolicy):
    """Every block, in prefill and decode: :class:`SparsePolicy` unchanged."""

    name = "FULL"
