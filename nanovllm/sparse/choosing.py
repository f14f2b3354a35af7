"""What the policies that choose decode pages share: their options and the pages every sequence
reads (attention sinks, the recent window, the page being written).

The always-read pages follow StreamingLLM (Xiao et al., "Efficient Streaming Language Models with
Attention Sinks", ICLR 2024): the first tokens collect attention whatever the query, the recent
ones carry the local context (for a prompt, its question and the answer so far). Each is rounded
up to whole pages; the reads are counted in the decode density.

The budget may differ by layer (:func:`layer_budget_pages`): a layer's share of the same total
reads, as in PyramidKV (Cai et al., 2024) and Ada-KV (Feng et al., 2024), here with weights
calibrated once per model (``benchmarks/layer_budgets.py``).
"""
import math
from numbers import Real

from nanovllm.sparse.policy import SparsePolicy
from nanovllm.utils.checks import check_range

PAGE_SIZES = (16, 32, 64)
"""Tokens per page a choosing policy may use (``sparse_page_size``)."""


class ChoosingPolicy(SparsePolicy):
    """A policy that chooses decode pages per KV head (subclasses pick; see ``policy.py``).

    Args: scale; page_size (tokens per page, in :data:`PAGE_SIZES`); budget_tokens (picks per KV
    head and step, rounded up to whole pages; 0: none); sink_tokens, recent_tokens (always read,
    rounded up to whole pages); dense_layers (the first layers read every page); layer_weights
    (None: every layer reads ``budget_tokens``; else one positive weight per layer,
    :func:`layer_budget_pages`).

    Raises:
        ValueError: a value out of range (see :meth:`check_options`).
    """

    chooses_decode_pages = True
    options = ("sparse_page_size", "sparse_sink_tokens", "sparse_recent_tokens", "sparse_dense_layers")

    def __init__(self, scale: float, page_size: int, budget_tokens: int, sink_tokens: int, recent_tokens: int,
                 dense_layers: int, layer_weights=None):
        super().__init__(scale)
        if page_size not in PAGE_SIZES:
            raise ValueError(f"sparse_page_size must be one of {PAGE_SIZES}, got {page_size!r}")
        for name, value in (("sparse_token_budget", budget_tokens), ("sparse_sink_tokens", sink_tokens),
                            ("sparse_recent_tokens", recent_tokens), ("sparse_dense_layers", dense_layers)):
            check_range(name, value, 0)
        self.page_size = page_size
        self.budget_pages = most_budget_pages(budget_tokens, page_size, layer_weights)
        if layer_weights is not None:
            self.layer_budget_pages = layer_budget_pages(budget_tokens, page_size, layer_weights)
        self.sink_pages, self.recent_pages = math.ceil(sink_tokens / page_size), math.ceil(recent_tokens / page_size)
        self.dense_layers = dense_layers

    @classmethod
    def check_options(cls, config) -> None:
        """``sparse_page_size`` one of :data:`PAGE_SIZES` dividing ``kvcache_block_size``;
        ``sparse_sink_tokens`` and ``sparse_recent_tokens`` in ``[0, max_model_len]``;
        ``sparse_dense_layers`` in ``[0, num_hidden_layers]`` (all layers dense: FULL's reads)."""
        page = config.sparse_page_size
        if page not in PAGE_SIZES or config.kvcache_block_size % page:
            raise ValueError(f"sparse_page_size must be one of {PAGE_SIZES} and divide kvcache_block_size="
                             f"{config.kvcache_block_size}, got {page!r}")
        for name in ("sparse_sink_tokens", "sparse_recent_tokens"):
            check_range(name, getattr(config, name), 0, config.max_model_len)
        check_range("sparse_dense_layers", config.sparse_dense_layers, 0, config.hf_config.num_hidden_layers)

    @classmethod
    def decode_fixed_tokens(cls, config) -> int:
        page = config.sparse_page_size
        return (math.ceil(config.sparse_sink_tokens / page) + math.ceil(config.sparse_recent_tokens / page) + 1) * page


def check_layer_weights(weights, num_layers: int) -> tuple[float, ...]:
    """``sparse_layer_budget_weights`` as a tuple of floats.

    Raises:
        ValueError: not a list or tuple of ``num_layers`` finite numbers > 0, naming the value.
    """
    name = "sparse_layer_budget_weights"
    if not isinstance(weights, (list, tuple)) or len(weights) != num_layers:
        raise ValueError(f"{name} must be a list or tuple of num_hidden_layers={num_layers} weights, got {weights!r}")
    for layer, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{name}[{layer}] must be a finite number > 0, got {weight!r}")
    return tuple(float(weight) for weight in weights)


def most_budget_pages(budget_tokens: int, page_size: int, weights: tuple[float, ...] | None) -> int:
    """The most picks per KV head and step at any layer (pages): ``ceil(budget_tokens / page_size)``
    without weights, else the largest of :func:`layer_budget_pages`."""
    if weights is None:
        return math.ceil(budget_tokens / page_size)
    return max(layer_budget_pages(budget_tokens, page_size, weights))


def layer_budget_pages(budget_tokens: int, page_size: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    """Each layer's picks per KV head and step (pages) when the layers share ``len(weights) x
    budget_tokens`` by ``weights`` (checked by :func:`check_layer_weights`): layer ``l`` picks
    ``budget_tokens x weights[l] / mean(weights)`` tokens, rounded up to whole pages (at least one),
    so the total is the uniform budget's or a few pages more. Equal weights give every layer
    ``ceil(budget_tokens / page_size)``."""
    largest = max(weights)
    shares = [weight / largest for weight in weights]  # in (0, 1]: their sum cannot overflow
    total = math.fsum(shares)
    return tuple(max(1, math.ceil(budget_tokens * share * len(shares) / total / page_size - 1e-9))
                 for share in shares)
