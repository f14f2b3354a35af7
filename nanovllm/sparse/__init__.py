"""Sparse-attention policies: which KV blocks attention reads (``policy.py``: the interface and
the registry; importing this package registers FULL, QUEST, STREAMING, XATTN_BSA, MOMENTS
and ORACLE)."""
from nanovllm.sparse.full import FullAttentionPolicy
from nanovllm.sparse.policy import (DecodeCandidates, SparsePolicy, check_unused_options, choosing_policy_names,
                                    create_policy, policy_class, policy_names, register_policy, registered_policies)
from nanovllm.sparse.quest import DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET, QuestPolicy
from nanovllm.sparse.stats import SparseStats
from nanovllm.sparse.streaming import StreamingPolicy
from nanovllm.sparse.xattn import XAttentionBSAPolicy
from nanovllm.sparse.moments import MomentsPolicy
from nanovllm.sparse.oracle import OraclePolicy  # registered last: a measurement, not a default

__all__ = ["DEFAULT_GROUP_SCORE", "DEFAULT_RADIUS_WEIGHT", "DEFAULT_TOKEN_BUDGET", "DecodeCandidates",
           "FullAttentionPolicy", "MomentsPolicy", "OraclePolicy", "QuestPolicy", "SparsePolicy", "SparseStats",
           "StreamingPolicy", "XAttentionBSAPolicy", "check_unused_options", "choosing_policy_names", "create_policy",
           "policy_class", "policy_names", "register_policy", "registered_policies"]
