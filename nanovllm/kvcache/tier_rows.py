"""The GPU tier as one table of rows, as decode with a choosing policy (QUEST) reads it.

Decode with a choosing policy addresses the GPU tier of all layers as one table of rows
``[L * layer_rows + staging_rows, block_size, Hkv, D]`` (keys, values): row ``layer * layer_rows +
b`` is block ``b`` of ``layer`` (the block manager's blocks, then the reuse cache's rows,
``reuse.py``), the last ``staging_rows`` rows are the *staging rows*: where picked host blocks
that the reuse cache does not keep are gathered, shared by all layers (layer ``l + 1``'s gather
runs after layer ``l``'s attention on the compute stream). So one paged read covers GPU-tier
blocks, reuse-cache rows and staging rows, and the staging rows exist once, not per layer.
"""
from typing import NamedTuple

import torch

from nanovllm.sparse import policy_class

STAGING_SEQS = 8
"""Sequences whose picks the staging rows hold at once: ``sparse_topk_blocks`` rows each."""


def staging_rows(config) -> int:
    """Staging rows (shared by all layers) of a cache with a host tier and a policy that chooses
    decode blocks: the policy's most picks per sequence and layer
    (:meth:`~nanovllm.sparse.SparsePolicy.decode_pick_limit`) for up to :data:`STAGING_SEQS`
    sequences (``max_num_seqs`` if fewer). One layer of one block each, so 8 sequences of top-k 4 cost 32
    layer blocks (512 MiB at Llama-3.1-8B's 4,096-token blocks, beside 64 GiB of its GPU tier). A
    step whose picks could miss more than the victim and staging rows hold reads its sequences in
    groups (``selection.py``)."""
    return policy_class(config.sparse_policy).decode_pick_limit(config) * min(config.max_num_seqs, STAGING_SEQS)


class TierRows(NamedTuple):
    """The GPU tier as one table of rows (see the module doc): ``num_layers`` layers of
    ``layer_rows`` rows, then ``staging_rows`` rows shared by all layers."""

    num_layers: int
    layer_rows: int
    staging_rows: int

    @property
    def staging_base(self) -> int:
        """The row of staging row 0."""
        return self.num_layers * self.layer_rows

    @property
    def total(self) -> int:
        """Rows of the table."""
        return self.staging_base + self.staging_rows

    def per_layer(self, rows: torch.Tensor) -> torch.Tensor:
        """The layers' part of ``rows`` ``[2, total, ...]`` (keys, values) as ``[2, num_layers,
        layer_rows, ...]``, a view."""
        return rows[:, :self.staging_base].unflatten(1, (self.num_layers, self.layer_rows))

    def row(self, layer: int, block: int) -> int:
        """The row of GPU-tier block (or reuse-cache row) ``block`` of ``layer``."""
        return layer * self.layer_rows + block
