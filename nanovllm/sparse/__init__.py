"""Sparse-attention policies: which KV blocks attention reads (see policy.py for the interface)."""
from nanovllm.sparse.full import FullAttentionPolicy
from nanovllm.sparse.policy import DecodeBlocks, SparsePolicy, SparsePolicyType
from nanovllm.sparse.quest import QuestPolicy
from nanovllm.sparse.stats import SparseStats
from nanovllm.sparse.xattn import XAttentionBSAPolicy


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


__all__ = ["DecodeBlocks", "FullAttentionPolicy", "QuestPolicy", "SparsePolicy", "SparsePolicyType",
           "SparseStats", "XAttentionBSAPolicy", "create_policy"]
