"""Sparse-attention policies: which KV blocks attention reads (``policy.py``: the interface and
the registry; importing this package registers FULL, QUEST, STREAMING and XATTN_BSA)."""
from nanovllm.sparse.full import FullAttentionPolicy
from nanovllm.sparse.policy import (DecodeCandidates, SparsePolicy, choosing_policy_names, create_policy, policy_class,
                                    policy_names, register_policy, registered_policies)
from nanovllm.sparse.quest import QuestPolicy
from nanovllm.sparse.stats import SparseStats
from nanovllm.sparse.streaming import StreamingPolicy
from nanovllm.sparse.xattn import XAttentionBSAPolicy

__all__ = ["DecodeCandidates", "FullAttentionPolicy", "QuestPolicy", "SparsePolicy", "SparseStats", "StreamingPolicy",
           "XAttentionBSAPolicy", "choosing_policy_names", "create_policy", "policy_class", "policy_names", "register_policy",
           "registered_policies"]
