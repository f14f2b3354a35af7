"""Sparse-attention policies for offload mode (see policy.py for the interface)."""
from nanovllm.kvcache.sparse.full_policy import FullAttentionPolicy
from nanovllm.kvcache.sparse.policy import PolicyContext, SparsePolicy, SparsePolicyType


def create_policy(policy_type: SparsePolicyType, scale: float, **kwargs) -> SparsePolicy:
    """The policy for ``policy_type``. Raises ValueError for a type not built yet."""
    policies = {SparsePolicyType.FULL: FullAttentionPolicy}
    if policy_type not in policies:
        raise ValueError(f"sparse policy {policy_type.value} is not available; "
                         f"available: {[t.value for t in policies]}")
    return policies[policy_type](scale, **kwargs)


__all__ = ["FullAttentionPolicy", "PolicyContext", "SparsePolicy", "SparsePolicyType", "create_policy"]
