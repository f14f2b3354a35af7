"""Per-forward attention metadata, set by the model runner and read by attention layers.

The model's forward signature stays ``(input_ids, positions)`` as in HF and nano-vLLM; what the
attention layers need about the batch travels here, set before and cleared after each forward.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class OffloadBatch:
    """Offload-mode layout of one step, per sequence (see ``kvcache/hybrid_manager.py``).

    Attributes:
        cpu_blocks: CPU blocks holding each sequence's earlier KV (position order).
        block_lens: valid tokens in each of those blocks.
        chunk_blocks: prefill only, the CPU block each sequence's current chunk goes to.
        decode_rows, decode_lens: decode only, each sequence's decode-buffer row and the tokens
            in it including the current one; ``rows`` / ``offsets`` are the same as int64
            device tensors for the batched store.
    """

    cpu_blocks: list[list[int]]
    block_lens: list[list[int]]
    chunk_blocks: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


@dataclass
class Context:
    """Batch layout of one forward pass.

    Attributes:
        is_prefill: prefill (packed variable-length queries) or decode (one query per sequence).
        seqlens_q: prefill only, new tokens per sequence (host list, no device sync).
        seqlens_k: prefill only, total context per sequence including cached tokens.
        slot_mapping: int32 ``[num_tokens]`` flat cache slot of each new token, -1 = do not store.
        context_lens: decode only, int32 ``[batch]`` tokens each sequence attends to.
        block_tables: int32 ``[batch, max_blocks]`` (-1 padded) or None when no prefill sequence
            reads cached KV.
        offload: offload mode's per-sequence layout, None in GPU-only mode.
    """

    is_prefill: bool = False
    seqlens_q: list[int] = field(default_factory=list)
    seqlens_k: list[int] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    offload: OffloadBatch | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context):
    global _CONTEXT
    _CONTEXT = context


def reset_context():
    set_context(Context())
