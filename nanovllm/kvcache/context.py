"""Per-forward attention metadata, set by the KV cache before each forward and read by the
attention layers.

The model's forward signature stays ``(input_ids, positions)`` as in HF and nano-vLLM; what the
attention layers need about the batch travels here, set before and cleared after each forward.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanovllm.utils.tensors import to_device

if TYPE_CHECKING:
    from nanovllm.kvcache.selection import DecodeSelection


@dataclass
class PrefixGather:
    """Where the prefix keys and values ``start .. num_tokens - 1`` of a prefill sequence with
    host-tier blocks live (built once per step, read by every layer).

    Attributes:
        num_tokens: prefix tokens (the sequence's context before this step's chunk).
        gpu: ``(index, GPU block)`` of the gathered blocks in the GPU tier, index = the logical
            block - the first gathered block.
        host: ``(index, host block)`` of the gathered blocks in the host tier (indices as above).
        start: the first gathered token, a block boundary: 0, or with sliding windows in every
            layer the first block the widest window shows to the chunk's first query.
    """

    num_tokens: int
    gpu: list[tuple[int, int]]
    host: list[tuple[int, int]]
    start: int = 0
    _spans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def blocks(self, first: int, last: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The gathered blocks of indices ``first .. last - 1``, re-indexed from ``first``: the GPU
        tier's as int64 device tensors ``(index, GPU block)`` and the host tier's as ``(index, host
        block)`` pairs; built once per step and span (every layer reads the same spans)."""
        if (first, last) not in self._spans:
            gpu = [(j - first, block) for j, block in self.gpu if first <= j < last]
            index, ids = (list(t) for t in zip(*gpu)) if gpu else ([], [])
            self._spans[first, last] = (to_device(index, torch.int64, device), to_device(ids, torch.int64, device),
                                        [(j - first, block) for j, block in self.host if first <= j < last])
        return self._spans[first, last]


@dataclass
class WindowReads:
    """Decode reads of the layers with one sliding window (``nanovllm.kvcache.window``).

    Attributes:
        block_tables: int32 ``[batch, max_blocks]``: each row's GPU-tier blocks from the window's
            first block on, in order (-1 padded).
        context_lens: int32 ``[batch]`` tokens of those blocks (the new token included).
        context_starts: int32 ``[batch]`` tokens at the head of each table before the window.
        host_loads: ``(batch row, host block)`` of the host-tier blocks in the window, in order;
        host_skips: for each, its tokens before the window.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    context_starts: torch.Tensor
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    host_skips: list[int] = field(default_factory=list)


@dataclass
class Context:
    """Batch layout of one forward pass.

    Attributes:
        is_prefill: prefill (packed variable-length queries) or decode (one query per sequence).
        seqlens_q: prefill only, new tokens per sequence (host list, no device sync).
        seqlens_k: prefill only, total context per sequence including cached tokens.
        slot_mapping: int64 ``[num_tokens]`` flat GPU-tier slot of each new token, -1 = do not
            store; None when the forward must not touch the cache (warm-up, scoring).
        context_lens: decode only, int32 ``[batch]`` tokens each sequence reads in the GPU tier.
        block_tables: int32 ``[batch, max_blocks]`` GPU-tier blocks (-1 padded). Prefill: every
            logical block (-1 where it is on the host); None when no sequence has a prefix.
            Decode: the GPU-resident blocks only, in order.
        prefix_gathers: prefill, by sequence index, the sequences whose prefix has host blocks.
        host_loads: decode, ``(batch row, host block)`` of every host-tier block of the batch (all
            read by every layer without a window unless the policy chooses).
        selection: decode, set when the sparse policy chooses blocks for some sequence
            (``nanovllm.kvcache.selection.DecodeSelection``).
        windows: decode, the reads of the layers with each sliding window (by window); the fields
            above serve the layers without one (None when every layer has a window).
        key_sums: a calibration prefill (``slot_mapping`` None), float32 ``[L, Hkv, D]``: each
            layer adds its keys after RoPE, summed over the step's tokens
            (``nanovllm.kvcache.key_offset``); None in every other step.
        graph_batch: decode, the captured CUDA-graph batch size the step is padded to
            (``step_inputs.py``) and replayed at when the runner has captured graphs (with
            ``enforce_eager`` a paged-only step is padded alike and runs eagerly: the same shapes);
            0: not padded, eager.
    """

    is_prefill: bool = False
    seqlens_q: list[int] = field(default_factory=list)
    seqlens_k: list[int] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    prefix_gathers: dict[int, PrefixGather] = field(default_factory=dict)
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    selection: "DecodeSelection | None" = None
    windows: dict[int, WindowReads] = field(default_factory=dict)
    key_sums: torch.Tensor | None = None
    graph_batch: int = 0

    @property
    def paged_only(self) -> bool:
        """Decode reads only GPU-resident blocks, every one it can see (CUDA-graph safe)."""
        return not self.host_loads and self.selection is None and not any(r.host_loads for r in self.windows.values())


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context):
    global _CONTEXT
    _CONTEXT = context


def reset_context():
    set_context(Context())
