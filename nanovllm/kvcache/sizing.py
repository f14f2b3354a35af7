"""Byte budgets: how many KV blocks each tier of the cache gets (per rank).

- **GPU tier**: exactly ``num_kvcache_blocks`` when given. Otherwise on CUDA, what
  ``gpu_memory_utilization`` of the device leaves after this process's peak use in the warm-up
  (weights, activations of a ``max_num_batched_tokens`` prefill), the ring slots, QUEST's reuse
  cache and staging rows and the sparse policy's per-block metadata; on CPU, what the
  configuration can use (``max_num_seqs`` full sequences of ``max_model_len``) capped at
  ``CPU_KV_MEMORY_FRACTION`` of the available memory.
- **Host tier** (``enable_cpu_offload``): exactly ``num_cpu_kvcache_blocks`` when given, else what
  the configuration can use capped at ``cpu_memory_utilization`` of the available host memory.
  Ranks on one host split its memory evenly.
"""
import logging
import os
from typing import NamedTuple

import torch

from nanovllm.config import Config

logger = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.25
"""CPU device: largest share of the available memory the (device) KV cache may take."""
GPU_HEADROOM = 256 << 20
"""Bytes left free on the GPU besides the budget (CUDA context growth, allocator slack)."""
RING_BYTES = 128 << 20
"""Device bytes of the host tier's ring when ``num_ring_slots`` is None (each half a group of
loads folded at once: ``ring.py``): a half of 64 MiB keeps a small model's groups few per layer,
so a group's launches and the copy engine's per-copy cost are paid per 64 MiB of host blocks."""
MIN_RING_SLOTS = 4


class KVGeometry(NamedTuple):
    """One rank's KV shape: per layer and token, ``num_kv_heads x head_dim`` keys and values of
    ``cache_dtype`` (the storage dtype), with ``token_bytes`` of the layer's spec per token (an fp8
    cache's scales included: :attr:`~nanovllm.kvcache.spec.LayerKVSpec.token_bytes`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: torch.dtype
    token_bytes: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer, keys and values (and their scales)."""
        return self.num_layers * self.layer_block_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer of one block, keys and values and their scales (a ring slot, a
        staging row)."""
        return self.block_size * self.token_bytes


def ring_slots(num_ring_slots: int | None, geometry: KVGeometry) -> int:
    """The ring's slots: ``num_ring_slots``, or for None as many layer-blocks of ``geometry`` as
    :data:`RING_BYTES` hold, at least :data:`MIN_RING_SLOTS`."""
    if num_ring_slots is not None:
        return num_ring_slots
    return max(MIN_RING_SLOTS, RING_BYTES // geometry.layer_block_bytes)


class TierSizes(NamedTuple):
    gpu_blocks: int
    host_blocks: int


def host_memory_share(fraction: float, ranks_on_host: int) -> int:
    """Bytes of this host's available memory for one rank: ``fraction`` of it, split evenly."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * fraction) // ranks_on_host


def gpu_budget(device: torch.device, utilization: float) -> int:
    """Bytes for KV: this process's share of the GPU minus its own peak use, never more than
    what is free now (less a headroom)."""
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_reserved(device)
    budget = max(0, min(int(total * utilization) - peak, free - GPU_HEADROOM))
    logger.info("GPU budget for the KV cache: %.2f GiB = min(%.2f GiB (gpu_memory_utilization=%g of %.2f GiB) - "
                "%.2f GiB (this process's peak reserved in the warm-up), %.2f GiB free - %.2f GiB headroom)",
                budget / 2**30, total * utilization / 2**30, utilization, total / 2**30, peak / 2**30,
                free / 2**30, GPU_HEADROOM / 2**30)
    return budget


def wanted_blocks(config: Config) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    return config.max_num_seqs * -(-config.max_model_len // config.kvcache_block_size)


def host_blocks(config: Config, geometry: KVGeometry, ranks_on_host: int) -> int:
    """Host-tier blocks of this rank when the cache has a host tier (``KVCache.host_blocks``
    decides whether it has one)."""
    if config.num_cpu_kvcache_blocks > 0:
        return config.num_cpu_kvcache_blocks
    share = host_memory_share(config.cpu_memory_utilization, ranks_on_host)
    return min(share // geometry.block_bytes, wanted_blocks(config))


def gpu_blocks(config: Config, geometry: KVGeometry, device: torch.device, reserved_bytes: int,
               metadata_bytes: int, ranks_on_host: int) -> int:
    """GPU-tier blocks of this rank. ``reserved_bytes``: device memory the cache needs besides
    its blocks (ring slots, host blocks' metadata, QUEST's reuse cache and staging rows);
    ``metadata_bytes``: per GPU block."""
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    if device.type == "cuda":
        return max(0, gpu_budget(device, config.gpu_memory_utilization) - reserved_bytes) \
            // (geometry.block_bytes + metadata_bytes)
    share = host_memory_share(CPU_KV_MEMORY_FRACTION, ranks_on_host)
    return min(share // geometry.block_bytes, wanted_blocks(config))


def check_capacity(config: Config, geometry: KVGeometry, sizes: TierSizes, device: torch.device) -> None:
    """Raises RuntimeError (with the numbers) unless the tiers hold one ``max_model_len``
    sequence, and with a host tier, unless the GPU tier holds a sequence's first block and the
    block it writes (ValueError when ``num_kvcache_blocks`` set it below that). ``device``: the
    GPU tier's (what sized it, for the advice)."""
    block = geometry.block_size
    capacity = (sizes.gpu_blocks + sizes.host_blocks) * block
    if capacity < config.max_model_len:
        sized_by = ("raise num_kvcache_blocks or gpu_memory_utilization" if device.type == "cuda" else
                    f"set num_kvcache_blocks (on {device.type} the cache takes at most "
                    f"{CPU_KV_MEMORY_FRACTION:g} of the available memory)")
        raise RuntimeError(
            f"the KV cache holds {sizes.gpu_blocks} GPU + {sizes.host_blocks} host blocks x {block} = {capacity} "
            f"tokens, fewer than max_model_len={config.max_model_len}: not enough memory for one sequence "
            f"(block = {geometry.block_bytes} bytes); lower max_model_len or kvcache_block_size, {sized_by}, "
            f"or set enable_cpu_offload=True for a host tier")
    if config.enable_cpu_offload and not sizes.host_blocks:
        raise RuntimeError(f"the host tier holds 0 blocks of {geometry.block_bytes} bytes: cpu_memory_utilization="
                           f"{config.cpu_memory_utilization} of this host's available memory is less than one block "
                           f"per rank; raise it, set num_cpu_kvcache_blocks, or turn enable_cpu_offload off")
    if sizes.host_blocks and sizes.gpu_blocks < 2:
        if config.num_kvcache_blocks > 0:
            raise ValueError(f"num_kvcache_blocks must be >= 2 with enable_cpu_offload=True (the GPU tier holds a "
                             f"sequence's first block and the block it writes), got {config.num_kvcache_blocks}")
        raise RuntimeError(f"the GPU tier has {sizes.gpu_blocks} block(s); with a host tier it needs at least 2 "
                           f"(a sequence's first block and the block it writes): raise gpu_memory_utilization")
