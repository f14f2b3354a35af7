"""STREAMING: attention sinks and a recent window, no query-aware choice (Xiao et al.,
"Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

Decode reads each sequence's first ``sparse_sink_tokens`` and last ``sparse_recent_tokens``
tokens (whole pages) and the page being written; prefill is dense. The baseline that shows what
query-aware selection (QUEST) buys.
"""
from nanovllm.sparse.choosing import ChoosingPolicy
from nanovllm.sparse.policy import register_policy


@register_policy
class StreamingPolicy(ChoosingPolicy):
    """Args: scale, page_size, sink_tokens, recent_tokens, dense_layers (as
    :class:`~nanovllm.sparse.choosing.ChoosingPolicy`, with no budget)."""

    name = "STREAMING"

    def __init__(self, scale: float, page_size: int = 16, sink_tokens: int = 16, recent_tokens: int = 256,
                 dense_layers: int = 0):
        super().__init__(scale, page_size, 0, sink_tokens, recent_tokens, dense_layers)

    @classmethod
    def from_config(cls, config, scale: float) -> "StreamingPolicy":
        return cls(scale, config.sparse_page_size, config.sparse_sink_tokens, config.sparse_recent_tokens,
                   config.sparse_dense_layers)
