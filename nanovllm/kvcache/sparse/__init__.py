"""Sparse-attention policies for offload mode (see policy.py for the interface)."""
from nanovllm.kvcache.sparse.full_policy import FullAttentionPolicy
from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy, SparsePolicyType
from nanovllm.kvcache.sparse.quest_policy import QuestPolicy
from nanovllm.kvcache.sparse.stats import SparseStats


def create_policy(config, scale: float) -> SparsePolicy:
    """The policy named by ``config.sparse_policy``, with its parameters from the config.

    Raises:
        ValueError: a policy type that is not built yet, or bad policy parameters.
    """
    policy_type = config.sparse_policy
    if policy_type is SparsePolicyType.FULL:
        return FullAttentionPolicy(scale)
    if policy_type is SparsePolicyType.QUEST:
        return QuestPolicy(scale, config.sparse_topk_blocks, config.sparse_threshold_blocks)
    raise ValueError(f"sparse policy {policy_type.value} is not available yet; available: "
                     f"{[SparsePolicyType.FULL.value, SparsePolicyType.QUEST.value]}")


__all__ = ["FullAttentionPolicy", "PolicyContext", "QuestPolicy", "SparsePolicy", "SparsePolicyType",
           "SparseStats", "create_policy"]
