"""Sparse-attention policies: offload mode's block selection, and XAttention's block-sparse prefill
in both modes (see policy.py for the interface)."""
from nanovllm.kvcache.sparse.full_policy import FullAttentionPolicy
from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy, SparsePolicyType
from nanovllm.kvcache.sparse.quest_policy import QuestPolicy
from nanovllm.kvcache.sparse.stats import SparseStats
from nanovllm.kvcache.sparse.xattn_policy import XAttentionBSAPolicy


def create_policy(config, scale: float) -> SparsePolicy:
    """The policy named by ``config.sparse_policy``, with its parameters from the config.

    Raises:
        ValueError: bad policy parameters.
    """
    policy_type = config.sparse_policy
    if policy_type is SparsePolicyType.FULL:
        return FullAttentionPolicy(scale)
    if policy_type is SparsePolicyType.QUEST:
        return QuestPolicy(scale, config.sparse_topk_blocks, config.sparse_threshold_blocks)
    return XAttentionBSAPolicy(scale, config.sparse_threshold, config.sparse_stride, config.sparse_block_size,
                               config.sparse_chunk_size)


__all__ = ["FullAttentionPolicy", "PolicyContext", "QuestPolicy", "SparsePolicy", "SparsePolicyType",
           "SparseStats", "XAttentionBSAPolicy", "create_policy"]
