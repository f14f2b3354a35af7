"""The GPU tier as one table of rows, as decode with a choosing policy (QUEST) reads it.

Decode with a choosing policy addresses the GPU tier of all layers as one table of rows
``[L * layer_rows + staging_rows, block_size, Hkv, D]`` (keys, values), viewed as pages
``[(L * layer_rows + staging_rows) * pages_per_block, page_size, Hkv, D]``: row ``layer * layer_rows +
b`` is block ``b`` of ``layer`` (the block manager's blocks, then the reuse cache's rows,
``reuse.py``), the last ``staging_rows`` rows are the *staging rows*: where read host pages that
the reuse cache does not keep are gathered, shared by all layers (layer ``l + 1``'s gather runs
after layer ``l``'s attention on the compute stream). So one paged read covers GPU-tier pages,
reuse-cache cells and staging pages, and the staging rows exist once, not per layer.
"""
from typing import NamedTuple

import torch

from nanovllm.sparse import policy_class
from nanovllm.utils.ints import cdiv

STAGING_SEQS = 8
"""Sequences whose host-tier reads the staging rows hold at once."""


def staging_rows(config) -> int:
    """Staging rows (shared by all layers) of a cache with a host tier and a policy that chooses
    decode pages: room for the most one sequence reads per KV head and step (the policy's picks,
    :meth:`~nanovllm.sparse.SparsePolicy.decode_pick_limit`, and its always-read pages,
    :meth:`~nanovllm.sparse.SparsePolicy.decode_fixed_tokens`) for up to :data:`STAGING_SEQS`
    sequences (``max_num_seqs`` if fewer), in whole blocks. Each KV head fills its own head of a
    staging page, so the heads share the pages. A step whose reads could miss more than the
    free reuse cells and the staging rows hold reads its sequences in groups (``selection.py``)."""
    policy = policy_class(config.sparse_policy)
    tokens = policy.decode_pick_limit(config) + policy.decode_fixed_tokens(config)
    return cdiv(tokens * min(config.max_num_seqs, STAGING_SEQS), config.kvcache_block_size)


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
