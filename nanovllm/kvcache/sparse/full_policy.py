"""FULL: attend to every offloaded block (exact attention)."""
from nanovllm.kvcache.sparse.policy import SparsePolicy


class FullAttentionPolicy(SparsePolicy):
    """Every block, in prefill and decode; the base pipeline unchanged."""
