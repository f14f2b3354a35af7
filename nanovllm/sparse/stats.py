"""Density statistics of the sparse attention of one engine (the KV cache and its attention
pipeline count, the policy only chooses).

- **compute density** (prefill): kept / causally visible sparse blocks (``sparse_block_size``
  tokens, 128 by default), counted over heads and query blocks. Policies whose prefill attends to
  every visible key (FULL, QUEST) report 1.0 without counting.
- **density** (decode, a policy that chooses decode blocks: QUEST, or a model with sliding
  windows): KV blocks read / KV blocks of the sequences' contexts, both tiers, per layer and
  sequence: the share of the KV that decode reads (a sequence the policy does not select for reads
  all of its blocks in its layer's window). Otherwise every block is read: 1.0 without counting.
- **communication density** (host tier, prefill and decode): host-tier blocks read (keys and
  values) / host-tier blocks the attention could have read, per layer. Prefill reads every host
  block of a sequence's context (1.0); QUEST's decode reads its selection, less the blocks found
  in the reuse cache.
- **reuse rate** (decode, QUEST with the reuse cache): host-tier blocks selected by the query that
  were found in the GPU-side reuse cache (not loaded) / host-tier blocks selected by the query,
  per layer; each (sequence, pick) counts. Decode's counts are added a step late (the picks reach
  the host after the step; ``KVCache.sparse_stats`` records the last step first).

Counting never syncs with the device: kept-block counts accumulate as device tensors, everything
else as Python ints; :meth:`SparseStats.to_dict` converts (one sync per layer, on request).
"""
import functools

import torch

from nanovllm.ops._triton import cdiv

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
        """Decode at ``layer`` read ``read`` of the ``context`` KV blocks of its sequences."""
        self._read[layer] = self._read.get(layer, 0) + read
        self._context[layer] = self._context.get(layer, 0) + context

    def add_comm(self, layer: int, is_prefill: bool, loaded: int, available: int) -> None:
        """``loaded`` of ``available`` host-tier blocks were read (keys and values) at ``layer``."""
        phase = PHASES[0] if is_prefill else PHASES[1]
        self._loaded[phase][layer] = self._loaded[phase].get(layer, 0) + loaded
        self._available[phase][layer] = self._available[phase].get(layer, 0) + available

    def add_reuse(self, layer: int, reused: int, selected: int) -> None:
        """Decode at ``layer`` found ``reused`` of ``selected`` query-selected host-tier blocks in
        the reuse cache."""
        self._reused[layer] = self._reused.get(layer, 0) + reused
        self._selected[layer] = self._selected.get(layer, 0) + selected

    def to_dict(self, dense_prefill: bool, dense_decode: bool) -> dict:
        """``{"prefill": {...}, "decode": {...}}`` of plain Python numbers (see
        ``LLMEngine.get_sparse_stats``); a density is None where nothing was counted.
        ``dense_prefill`` / ``dense_decode``: the policy attends to every visible key in prefill /
        reads every block in decode (density 1.0)."""
        kept = {layer: int(value) for layer, value in self._kept.items()}  # syncs, once per layer

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
        decode.update(reuse_rate=_ratio(sum(self._reused.values()), sum(self._selected.values())),
                      reused_host_blocks=sum(self._reused.values()), selected_host_blocks=sum(self._selected.values()),
                      density=1.0 if dense_decode else _ratio(sum(self._read.values()), sum(self._context.values())),
                      kept_blocks=None if dense_decode else sum(self._read.values()),
                      visible_blocks=None if dense_decode else sum(self._context.values()))
        for row in decode["per_layer"]:
            layer = row["layer"]
            row["reuse_rate"] = _ratio(self._reused.get(layer, 0), self._selected.get(layer, 0))
            row["density"] = 1.0 if dense_decode else _ratio(self._read.get(layer, 0), self._context.get(layer, 0))
        return {"prefill": prefill, "decode": decode}

    def _comm(self, phase: str, layers: list[int]) -> dict:
        loaded, available = self._loaded[phase], self._available[phase]
        return {"comm_density": _ratio(sum(loaded.values()), sum(available.values())),
                "loaded_host_blocks": sum(loaded.values()), "available_host_blocks": sum(available.values()),
                "per_layer": [{"layer": i, "comm_density": _ratio(loaded.get(i, 0), available.get(i, 0))}
                              for i in layers]}


def sum_sparse_stats(per_replica: list[dict]) -> dict:
    """``LLM.get_sparse_stats()`` of the whole engine: each phase's block counts summed over the
    replicas and its overall densities recomputed from the sums; ``"replicas"`` holds each
    replica's own dict (with its ``per_layer`` rows, which a sum of densities cannot give)."""
    def phase(name: str) -> dict:
        rows = [stats[name] for stats in per_replica]
        merged = {key: None if rows[0][key] is None else sum(row[key] for row in rows)
                  for key in ("kept_blocks", "visible_blocks", "loaded_host_blocks", "available_host_blocks",
                              "reused_host_blocks", "selected_host_blocks")
                  if key in rows[0]}
        merged["comm_density"] = _ratio(merged["loaded_host_blocks"], merged["available_host_blocks"])
        if "reuse_rate" in rows[0]:
            merged["reuse_rate"] = _ratio(merged["reused_host_blocks"], merged["selected_host_blocks"])
        if "density" in rows[0]:
            dense = merged["kept_blocks"] is None  # the policy's prefill is dense: 1.0 everywhere
            merged["density"] = 1.0 if dense else _ratio(merged["kept_blocks"], merged["visible_blocks"])
        return merged

    return {"policy": per_replica[0]["policy"], "prefill": phase("prefill"), "decode": phase("decode"),
            "replicas": per_replica}
