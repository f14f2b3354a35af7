"""Density statistics of the sparse attention of one engine (the KV cache and its attention
pipeline count, the policy only chooses).

- **compute density** (prefill): kept / causally visible sparse blocks (``sparse_block_size``
  tokens, 128 by default), counted over heads and query blocks. Policies whose prefill attends to
  every visible key (FULL, QUEST, STREAMING) report 1.0 without counting.
- **density** (decode, a policy that chooses decode pages, QUEST or STREAMING, or a model with
  sliding windows): tokens read per KV head / tokens of the sequences' contexts, both tiers, per
  layer and sequence: the share of the KV that decode reads, the always-read sinks, recent pages and page being written included (a
  sequence the policy does not select for reads all of its tokens; a layer with a sliding window
  reads the window's). Otherwise every token is read: 1.0 without counting.
- **communication density** (host tier, prefill and decode): bytes read from the host tier (keys
  and values) / bytes of the host-tier blocks the attention could have read, per layer. Prefill
  reads every host block of a sequence's context (1.0); a choosing policy's decode reads its
  host pages per KV head, less those found in the reuse cache.
- **reuse rate** (decode, a choosing policy with the reuse cache): host (page, KV head) reads
  found in the reuse cache (not loaded) / host (page, KV head) reads, per layer.

Counting never syncs with the device: counts known only there (kept blocks, gathered pages,
reuse hits) accumulate as device tensors, everything else as Python ints;
:meth:`SparseStats.to_dict` converts (syncs once per count, on request).
"""
import functools

import torch

from nanovllm.utils.ints import cdiv

PHASES = ("prefill", "decode")


@functools.lru_cache(maxsize=1024)
def causal_visible_blocks(seq_q: int, seq_k: int, block_size: int) -> int:
    """(query block, key block) pairs of ``block_size`` tokens that some query may see when the
    ``seq_q`` queries are the last of ``seq_k`` keys (the ``visible`` of ``block_layout``)."""
    offset, n_k = seq_k - seq_q, cdiv(seq_k, block_size)
    return sum(max(0, min(n_k, (offset + min((qb + 1) * block_size, seq_q) - 1) // block_size + 1))
               for qb in range(cdiv(seq_q, block_size)))


def _ratio(num, den) -> float | None:
    """``num / den`` as a float, None when ``den`` is 0 (nothing was counted)."""
    return float(num) / den if den else None


class SparseStats:
    """Per-layer block counters."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every count."""
        self._kept: dict[int, torch.Tensor | int] = {}
        self._visible: dict[int, int] = {}
        self._read: dict[int, int] = {}
        self._context: dict[int, int] = {}
        self._loaded = {phase: {} for phase in PHASES}
        self._available = {phase: {} for phase in PHASES}
        self._reused: dict[int, int] = {}
        self._selected: dict[int, int] = {}

    def add_compute(self, layer: int, kept: torch.Tensor | int, visible: int) -> None:
        """Prefill at ``layer`` kept ``kept`` (an int or a 0-dim device tensor, not synced) of
        ``visible`` causally visible sparse blocks (over heads)."""
        self._kept[layer] = self._kept.get(layer, 0) + kept
        self._visible[layer] = self._visible.get(layer, 0) + visible

    def add_reads(self, layer: int, read: int, context: int) -> None:
        """Decode at ``layer`` read ``read`` tokens per KV head of the ``context`` tokens of its
        sequences."""
        self._read[layer] = self._read.get(layer, 0) + read
        self._context[layer] = self._context.get(layer, 0) + context

    def add_comm(self, layer: int, is_prefill: bool, loaded: torch.Tensor | int, available: int) -> None:
        """``loaded`` bytes (an int or a 0-dim device tensor) were read from the host tier at
        ``layer``, of ``available`` bytes the attention could have read there."""
        phase = PHASES[0] if is_prefill else PHASES[1]
        self._loaded[phase][layer] = self._loaded[phase].get(layer, 0) + loaded
        self._available[phase][layer] = self._available[phase].get(layer, 0) + available

    def add_reuse(self, layer: int, reused: torch.Tensor | int, selected: torch.Tensor | int) -> None:
        """Decode at ``layer`` found ``reused`` of its ``selected`` host (page, KV head) reads in the
        reuse cache (ints or 0-dim device tensors)."""
        self._reused[layer] = self._reused.get(layer, 0) + reused
        self._selected[layer] = self._selected.get(layer, 0) + selected

    def to_dict(self, dense_prefill: bool, dense_decode: bool) -> dict:
        """``{"prefill": {...}, "decode": {...}}`` of plain Python numbers (see
        ``LLMEngine.get_sparse_stats``); a density is None where nothing was counted.
        ``dense_prefill`` / ``dense_decode``: the policy attends to every visible key in prefill /
        reads every token in decode (density 1.0)."""
        kept = _ints(self._kept)  # syncs, once per layer

        def density(layers) -> float | None:
            if dense_prefill:
                return 1.0
            return _ratio(sum(kept.get(i, 0) for i in layers), sum(self._visible.get(i, 0) for i in layers))

        prefill = self._comm("prefill", sorted(set(kept) | set(self._available["prefill"])))
        for row in prefill["per_layer"]:
            row["density"] = density([row["layer"]])
        prefill["density"] = density(kept)
        prefill["kept_blocks"] = None if dense_prefill else sum(kept.values())
        prefill["visible_blocks"] = None if dense_prefill else sum(self._visible.values())
        decode = self._comm("decode", sorted(set(self._available["decode"]) | set(self._context)))
        reused, read = _ints(self._reused), _ints(self._selected)
        decode.update(reuse_rate=_ratio(sum(reused.values()), sum(read.values())),
                      reused_host_pages=sum(reused.values()), read_host_pages=sum(read.values()),
                      density=1.0 if dense_decode else _ratio(sum(self._read.values()), sum(self._context.values())),
                      read_tokens=None if dense_decode else sum(self._read.values()),
                      context_tokens=None if dense_decode else sum(self._context.values()))
        for row in decode["per_layer"]:
            layer = row["layer"]
            row["reuse_rate"] = _ratio(reused.get(layer, 0), read.get(layer, 0))
            row["density"] = 1.0 if dense_decode else _ratio(self._read.get(layer, 0), self._context.get(layer, 0))
        return {"prefill": prefill, "decode": decode}

    def _comm(self, phase: str, layers: list[int]) -> dict:
        loaded, available = _ints(self._loaded[phase]), self._available[phase]
        return {"comm_density": _ratio(sum(loaded.values()), sum(available.values())),
                "loaded_host_bytes": sum(loaded.values()), "available_host_bytes": sum(available.values()),
                "per_layer": [{"layer": i, "comm_density": _ratio(loaded.get(i, 0), available.get(i, 0))}
                              for i in layers]}


def _ints(counts: dict) -> dict:
    """``counts`` with each value (an int or a 0-dim device tensor) as an int."""
    return {key: int(value) for key, value in counts.items()}


def sum_sparse_stats(per_replica: list[dict]) -> dict:
    """``LLM.get_sparse_stats()`` of the whole engine: each phase's counts summed over the
    replicas and its overall densities recomputed from the sums; ``"replicas"`` holds each
    replica's own dict (with its ``per_layer`` rows, which a sum of densities cannot give)."""
    def phase(name: str, kept: str, visible: str) -> dict:
        rows = [stats[name] for stats in per_replica]
        merged = {key: None if rows[0][key] is None else sum(row[key] for row in rows)
                  for key in (kept, visible, "loaded_host_bytes", "available_host_bytes", "reused_host_pages",
                              "read_host_pages")
                  if key in rows[0]}
        merged["comm_density"] = _ratio(merged["loaded_host_bytes"], merged["available_host_bytes"])
        if "reuse_rate" in rows[0]:
            merged["reuse_rate"] = _ratio(merged["reused_host_pages"], merged["read_host_pages"])
        dense = merged[kept] is None  # the policy reads every key of the phase: 1.0 everywhere
        merged["density"] = 1.0 if dense else _ratio(merged[kept], merged[visible])
        return merged

    return {"policy": per_replica[0]["policy"], "prefill": phase("prefill", "kept_blocks", "visible_blocks"),
            "decode": phase("decode", "read_tokens", "context_tokens"), "replicas": per_replica}
