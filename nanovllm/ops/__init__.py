"""Attention kernels and their torch references (see docs/ops.md for the contract)."""

from .chunked_attention import (
    flash_attn_with_lse,
    flash_attn_with_lse_ref,
    merge_attention_outputs,
    merge_attention_outputs_ref,
)
from .decode_attention import decode_attention, decode_attention_ref
from .prefill_attention import prefill_attention, prefill_attention_ref
from .store_kv import gather_kvcache, store_kvcache, store_kvcache_ref

__all__ = [
    "decode_attention",
    "decode_attention_ref",
    "flash_attn_with_lse",
    "flash_attn_with_lse_ref",
    "gather_kvcache",
    "merge_attention_outputs",
    "merge_attention_outputs_ref",
    "prefill_attention",
    "prefill_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
