"""Triton kernels and their torch references (see docs/ops.md for the contract)."""

from .block_sparse_attention import block_sparse_attention, block_sparse_attention_ref
from .chunked_attention import (
    flash_attn_with_lse,
    flash_attn_with_lse_ref,
    merge_attention_outputs,
    merge_attention_outputs_ref,
)
from .decode_attention import decode_attention, decode_attention_ref
from .decode_merge import decode_attend_merge, decode_attend_merge_ref
from .host_gather import gather_host_pages, gather_host_pages_ref
from .prefill_attention import prefill_attention, prefill_attention_ref
from .rmsnorm import rms_norm, rms_norm_ref
from .rotary import KVStore, apply_rotary, apply_rotary_ref
from .sample_race import sample_race, sample_race_ref
from .silu_and_mul import silu_and_mul, silu_and_mul_ref
from .store_kv import gather_kvcache, store_kvcache, store_kvcache_ref
from .xattn_estimate import xattn_block_scores, xattn_block_scores_ref
from .xattn_select import block_density, xattn_select_blocks, xattn_select_blocks_ref

__all__ = [
    "KVStore",
    "apply_rotary",
    "apply_rotary_ref",
    "block_density",
    "block_sparse_attention",
    "block_sparse_attention_ref",
    "decode_attend_merge",
    "decode_attend_merge_ref",
    "decode_attention",
    "decode_attention_ref",
    "flash_attn_with_lse",
    "flash_attn_with_lse_ref",
    "gather_host_pages",
    "gather_host_pages_ref",
    "gather_kvcache",
    "merge_attention_outputs",
    "merge_attention_outputs_ref",
    "prefill_attention",
    "prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "sample_race",
    "sample_race_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kvcache",
    "store_kvcache_ref",
    "xattn_block_scores",
    "xattn_block_scores_ref",
    "xattn_select_blocks",
    "xattn_select_blocks_ref",
]
