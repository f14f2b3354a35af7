"""The sparse-policy interface: a policy chooses what attention reads, nothing else.

The attention pipeline (``nanovllm/kvcache/tiered_attention.py``) asks the engine's policy two questions:

- **prefill**: :meth:`SparsePolicy.prefill_mask`, a block-sparse mask over a sequence's chunk of
  queries and its whole context (None: dense);
- **decode** (a policy that :attr:`~SparsePolicy.chooses_decode_pages`): the unit is a *page* of
  :attr:`~SparsePolicy.page_size` tokens, chosen per KV head. Every sequence reads its first
  :attr:`~SparsePolicy.sink_pages` pages (attention sinks) and its last
  :attr:`~SparsePolicy.recent_pages` pages before the page being written, and that page
  (:meth:`SparsePolicy.fixed_pages`); :meth:`SparsePolicy.select_decode_pages` picks up to
  :meth:`~SparsePolicy.budget_at` of the other pages (the *candidates*) per KV head, with the
  layer's query, as a device tensor the pipeline consumes on the device. A sequence with no more
  candidates than the budget (:meth:`SparsePolicy.selects`), and every sequence at the first
  :attr:`~SparsePolicy.dense_layers` layers, reads everything.

Policies keep per-page metadata through hooks the cache calls: :meth:`~SparsePolicy.allocate`
once the tiers are sized, :meth:`~SparsePolicy.on_pages_full` when pages of GPU blocks become full,
:meth:`~SparsePolicy.on_spill` when blocks are copied to the host tier and
:meth:`~SparsePolicy.on_load` when they are copied back. Metadata of both tiers is indexed by
*metadata slot*: GPU-tier block ``g`` is slot ``g``, host-tier block ``h`` is slot
``num_gpu_blocks + h``; page ``j`` of the block in slot ``s`` is *metadata page* ``s * pages per
block + j``. A policy never copies KV, never touches streams, ring slots or statistics.
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
    """The policies that choose decode blocks (:attr:`SparsePolicy.chooses_decode_pages`)."""
    return [name for name, cls in _POLICIES.items() if cls.chooses_decode_pages]


def policy_class(name) -> type["SparsePolicy"]:
    """The policy registered as ``name`` (case-insensitive).

    Raises:
        ValueError: no such policy, naming the choices.
    """
    cls = _POLICIES.get(str(name).upper())
    if cls is None:
        raise ValueError(f"sparse_policy must be one of {policy_names()}, got {name!r}")
    return cls


def check_unused_options(config, defaults: dict) -> None:
    """Refuse an option that some registered policy declares (:attr:`SparsePolicy.options`) but
    ``config.sparse_policy`` does not, set in ``config`` to another value than its default
    (``defaults``: option name to default): it would be ignored.

    Raises:
        ValueError: naming the option, its value, the policies that read it and its default.
    """
    chosen = policy_class(config.sparse_policy)
    readers: dict[str, list[str]] = {}
    for policy in registered_policies():
        for option in policy.options:
            readers.setdefault(option, []).append(policy.name)
    for option, names in readers.items():
        value, default = getattr(config, option), defaults[option]
        if option not in chosen.options and value != default:
            users = " or ".join(repr(n) for n in names)
            raise ValueError(f"{option}={value!r} is read by sparse_policy={users} only, but "
                             f"sparse_policy={config.sparse_policy!r} does not use it: choose {users} or leave "
                             f"{option} at its default {default!r}")


def create_policy(config, scale: float) -> "SparsePolicy":
    """The policy ``config.sparse_policy`` names, with its options from ``config``.

    Raises:
        ValueError: bad policy options.
    """
    return policy_class(config.sparse_policy).from_config(config, scale)


@dataclass
class DecodeCandidates:
    """The candidate pages of the decode sequences whose policy chooses (one step): every page of
    a sequence but its fixed ones (:meth:`SparsePolicy.fixed_pages`), padded to ``C`` columns.

    Attributes:
        rows: the sequences' rows in the decode batch (host list, length ``S``).
        pages: int64 ``[S, C]`` on the device: the metadata page of candidate ``c`` (logical page
            ``first + c`` of the sequence), -1 for padding.
        first: the logical page of candidate 0 (the policy's :attr:`~SparsePolicy.sink_pages`).
        num_kv_heads: the KV heads each of which chooses.
    """

    rows: list[int]
    pages: torch.Tensor
    first: int
    num_kv_heads: int


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
    chooses_decode_pages = False
    """Decode reads a choice of pages per KV head (:meth:`select_decode_pages`); the attributes
    below describe it."""
    needs_block_metadata = False
    """The cache calls :meth:`on_pages_full`, :meth:`on_spill` and :meth:`on_load`."""
    choice_in_graphs = True
    """A choosing policy's :meth:`select_decode_pages` may be captured in decode CUDA graphs over
    candidates padded to ``max_model_len`` (no host sync; temporaries that scale with the candidates'
    metadata, not with their keys)."""
    page_size = 0
    """Tokens per page of a choosing policy (a divisor of the KV block size)."""
    sink_pages = recent_pages = budget_pages = dense_layers = 0
    """A choosing policy's always-read pages (the first ``sink_pages``; the ``recent_pages`` before
    the page being written), its most picks per KV head and step at a layer, and the first layers
    it reads whole."""
    layer_budget_pages: tuple[int, ...] | None = None
    """Picks per KV head and step of each layer when they differ by layer (None: ``budget_pages``
    at every layer); :meth:`budget_at`."""

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
    def decode_pick_limit(cls, config) -> int:
        """Tokens :meth:`select_decode_pages` picks per KV head and step at most under ``config``,
        whole pages (with :meth:`decode_fixed_tokens`, sizes the rows that hold a step's host-tier
        pages); 0 for a policy that does not choose."""
        return 0

    @classmethod
    def decode_fixed_tokens(cls, config) -> int:
        """Tokens a choosing sequence reads per KV head and step whatever the query, whole pages
        (its sink pages, its recent pages and the page being written); 0 for a policy that does
        not choose."""
        return 0

    # ---- metadata hooks ----------------------------------------------------------------
    def metadata_bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                                 dtype: torch.dtype) -> int:
        """Device bytes of per-block metadata (for every block of both tiers), budgeted before the
        GPU tier is sized. Default: none."""
        return 0

    def allocate(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_gpu_blocks: int, num_host_blocks: int) -> None:
        """Called once the tiers are sized: allocate per-block metadata here."""

    def on_pages_full(self, keys: torch.Tensor, gpu_ids: torch.Tensor) -> None:
        """Pages (:attr:`page_size` tokens; the whole block when 0) of GPU blocks ``gpu_ids``
        (int64 ``[n]``) became full this step: ``keys`` ``[num_layers, n, block_size, Hkv, D]``
        are those blocks' keys of every layer in the model's dtype (an fp8 cache's dequantized,
        so that metadata reads what attention reads). Metadata of a block's pages not yet full is never read (the page being written is
        always read whole, ``fixed_pages``)."""

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

    def budget_at(self, layer: int) -> int:
        """Picks per KV head and step at ``layer`` (pages)."""
        return self.budget_pages if self.layer_budget_pages is None else self.layer_budget_pages[layer]

    def selects(self, num_pages: int) -> bool:
        """Whether a decode step over a context of ``num_pages`` pages reads fewer than all of them
        at some layer (more candidates than the smallest :meth:`budget_at`; a layer whose budget
        holds every candidate picks them all)."""
        fewest = self.budget_pages if self.layer_budget_pages is None else min(self.layer_budget_pages)
        return self.chooses_decode_pages and num_pages - self.num_fixed_pages > fewest

    @property
    def num_fixed_pages(self) -> int:
        """Pages a choosing sequence reads whatever the query."""
        return self.sink_pages + self.recent_pages + 1

    def fixed_pages(self, num_pages: int) -> tuple[range, range]:
        """For a sequence of ``num_pages`` pages that :meth:`selects`: its sink pages and its last
        pages (the recent ones and the page being written), logical page indices."""
        return range(self.sink_pages), range(num_pages - self.recent_pages - 1, num_pages)

    def select_decode_pages(self, layer: int, q: torch.Tensor, candidates: DecodeCandidates) -> torch.Tensor:
        """The candidates each KV head of each sequence of ``candidates`` reads at ``layer``, chosen
        with its decode query, without syncing with the host.

        Args:
            q: ``[S, Hq, D]``, the queries of ``candidates.rows``.

        Returns:
            int64 ``[S, Hkv, k]`` on q's device, ``k = min(budget_at(layer), C)`` (C: the candidates'
            columns; the engine counts a step's reads and pads CUDA-graph rows by it): columns of
            ``candidates.pages`` (distinct per row and head), -1 for no pick. Default: none (a
            policy without picks has ``budget_pages`` 0).
        """
        return torch.empty(q.shape[0], candidates.num_kv_heads, 0, dtype=torch.int64, device=q.device)
