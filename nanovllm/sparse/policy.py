"""The sparse-policy interface: a policy chooses what attention reads, nothing else.

The attention pipeline (``nanovllm/kvcache/tiered_attention.py``) asks the engine's policy two questions:

- **prefill**: :meth:`SparsePolicy.prefill_mask`, a block-sparse mask over a sequence's chunk of
  queries and its whole context (None: dense);
- **decode**: :meth:`SparsePolicy.selects` (does this many blocks call for a choice?),
  :meth:`SparsePolicy.fixed_decode_blocks` (the blocks read whatever the query, known before the
  query exists, so the pipeline can start loading them early) and
  :meth:`SparsePolicy.select_decode_blocks`, the query-dependent picks among the other blocks, in
  both tiers, as a device tensor (the pipeline consumes it on the device; it reaches the host
  once per step, after the step).

Policies keep per-block metadata through hooks the cache calls: :meth:`~SparsePolicy.allocate`
once the tiers are sized, :meth:`~SparsePolicy.on_blocks_full` when GPU blocks become full,
:meth:`~SparsePolicy.on_spill` when blocks are copied to the host tier and
:meth:`~SparsePolicy.on_load` when they are copied back. Metadata of both tiers is indexed by
*metadata slot*: GPU-tier block ``g`` is slot ``g``, host-tier block ``h`` is slot
``num_gpu_blocks + h``. A policy never copies KV, never touches streams, ring slots or statistics.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

_POLICIES: dict[str, type["SparsePolicy"]] = {}


def register_policy(cls: type["SparsePolicy"]) -> type["SparsePolicy"]:
    """Class decorator: ``sparse_policy=cls.name`` (any case) selects ``cls``."""
    _POLICIES[cls.name] = cls
    return cls


def registered_policies() -> list[type["SparsePolicy"]]:
    """Every registered policy class, in registration order."""
    return list(_POLICIES.values())


def policy_names() -> list[str]:
    """The ``sparse_policy`` values accepted, in registration order."""
    return list(_POLICIES)


def choosing_policy_names() -> list[str]:
    """The policies that choose decode blocks (:attr:`SparsePolicy.chooses_decode_blocks`)."""
    return [name for name, cls in _POLICIES.items() if cls.chooses_decode_blocks]


def policy_class(name) -> type["SparsePolicy"]:
    """The policy registered as ``name`` (case-insensitive).

    Raises:
        ValueError: no such policy, naming the choices.
    """
    cls = _POLICIES.get(str(name).upper())
    if cls is None:
        raise ValueError(f"sparse_policy must be one of {policy_names()}, got {name!r}")
    return cls


def create_policy(config, scale: float) -> "SparsePolicy":
    """The policy ``config.sparse_policy`` names, with its options from ``config``.

    Raises:
        ValueError: bad policy options.
    """
    return policy_class(config.sparse_policy).from_config(config, scale)


@dataclass
class DecodeBlocks:
    """The candidate blocks of the decode sequences whose policy selects (one step), padded to
    ``M`` columns: every block but the fixed ones (:meth:`SparsePolicy.fixed_decode_blocks`).

    Attributes:
        rows: the sequences' rows in the decode batch (host list, length ``S``).
        num_blocks: each sequence's block count (host list), ``<= M``.
        slots: int64 ``[S, M]`` on the device: the metadata slot of logical block ``j`` of each
            sequence (GPU block ``g`` -> ``g``, host block ``h`` -> ``num_gpu_blocks + h``) where
            ``j`` is a candidate, -1 where it is fixed or padding.
    """

    rows: list[int]
    num_blocks: list[int]
    slots: torch.Tensor


class SparsePolicy:
    """FULL's behaviour (every block, dense prefill); subclasses override what they choose and
    declare it in the class attributes below, which the engine reads (never a policy's name).

    Args:
        scale: the attention's softmax scale (for policies that score with it).
    """

    name: ClassVar[str]
    """The ``sparse_policy`` value that selects the policy (upper case; :func:`register_policy`)."""
    options: ClassVar[tuple[str, ...]] = ()
    """The engine options (``Config`` fields) the policy reads."""
    dense_prefill = True
    """Prefill attends to every causally visible key (compute density 1.0, not counted)."""
    prefill_block_size: int | None = None
    """Sparse block of :meth:`prefill_mask`'s masks (policies with ``dense_prefill`` False)."""
    chooses_decode_blocks = False
    """:meth:`selects` may be True: decode asks :meth:`select_decode_blocks` per layer."""
    needs_block_metadata = False
    """The cache calls :meth:`on_blocks_full` and :meth:`on_spill`."""

    def __init__(self, scale: float):
        self.scale = scale

    @classmethod
    def check_options(cls, config) -> None:
        """Raise ValueError naming the option, the value and the limit for a bad value of one of
        :attr:`options` in ``config``."""

    @classmethod
    def from_config(cls, config, scale: float) -> "SparsePolicy":
        """The policy with its :attr:`options` from ``config``."""
        return cls(scale)

    @classmethod
    def decode_pick_limit(cls, config) -> int | None:
        """The most candidate blocks :meth:`select_decode_blocks` picks per sequence and layer under
        ``config`` (sizes the rows that hold picked host blocks); None: every candidate."""
        return None

    # ---- metadata hooks ----------------------------------------------------------------
    def metadata_bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                                 dtype: torch.dtype) -> int:
        """Device bytes of per-block metadata (for every block of both tiers), budgeted before the
        GPU tier is sized. Default: none."""
        return 0

    def allocate(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_gpu_blocks: int, num_host_blocks: int) -> None:
        """Called once the tiers are sized: allocate per-block metadata here."""

    def on_blocks_full(self, k_cache: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        """GPU blocks ``gpu_ids`` (int64 ``[n]``) became full: their keys of every layer are
        ``k_cache[:, gpu_ids]`` (``k_cache``: ``[num_layers, >= num_gpu_blocks, block_size, Hkv, D]``)."""

    def on_spill(self, gpu_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        """Full blocks copied from the GPU tier (``gpu_ids``) to the host tier (``host_ids``): a
        spill, or an evicted prefix-cache block written back (int64 ``[n]``, no repeated host id)."""

    def on_load(self, host_ids: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        """Full blocks copied from the host tier (``host_ids``) back to the GPU tier (``gpu_ids``): a
        prefix-cache hit loaded back (int64 ``[n]``, no repeated GPU id)."""

    # ---- choices -----------------------------------------------------------------------
    def prefill_mask(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """Block-sparse mask for one sequence's prefill chunk q ``[Sq, Hq, D]`` over its whole
        context k ``[Sk, Hkv, D]`` (the chunk is the last ``Sq`` keys); None: dense."""
        return None

    def selects(self, num_blocks: int) -> bool:
        """Whether a decode step over ``num_blocks`` blocks reads fewer than all of them."""
        return False

    def fixed_decode_blocks(self, num_blocks: int) -> list[int]:
        """For a sequence of ``num_blocks`` blocks that :meth:`selects`: the logical blocks its
        decode reads whatever the query, increasing (the pipeline adds the last block, the one
        being written, in any case). Default: the first and the last."""
        return sorted({0, num_blocks - 1})

    def max_decode_picks(self, num_candidates: int) -> int:
        """The most candidates :meth:`select_decode_blocks` picks for a sequence of
        ``num_candidates`` (bounds the blocks a decode step may have to gather). Default: all."""
        return num_candidates

    def select_decode_blocks(self, layer: int, q: torch.Tensor, blocks: DecodeBlocks) -> torch.Tensor:
        """The candidates each sequence of ``blocks`` reads at ``layer``, chosen with its decode
        query, without syncing with the host.

        Args:
            q: ``[S, Hq, D]``, the queries of ``blocks.rows``.

        Returns:
            int64 ``[S, k]`` on q's device: logical block indices (candidates of
            ``blocks.slots``), each at most once per row, -1 for no pick. Default: every candidate.
        """
        columns = torch.arange(blocks.slots.shape[1], device=blocks.slots.device)
        return torch.where(blocks.slots >= 0, columns, -1)
