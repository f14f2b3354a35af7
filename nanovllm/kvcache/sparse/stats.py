"""Density statistics of one sparse policy (each policy instance owns a ``SparseStats``).

- **compute density** (prefill): kept / causally visible sparse blocks (``sparse_block_size``
  tokens, 128 by default), counted over heads and query blocks. Policies that attend to every
  visible key (FULL, QUEST's prefill) report 1.0 without counting.
- **communication density** (offload mode, prefill and decode): CPU blocks loaded (keys and
  values, for attention) / CPU blocks available. XAttention's estimation also streams the keys of
  every available block twice (``estimate_k_loads``, key-only loads; ``OffloadEngine.bytes_h2d``
  has the bytes).

Counting never syncs with the device: kept-block counts accumulate as device tensors, everything
else as Python ints; :meth:`SparseStats.to_dict` converts (one sync per layer, on request).
"""
import torch

PHASES = ("prefill", "decode")


def _ratio(num, den) -> float | None:
    return float(num) / den if den else None


class SparseStats:
    """Per-layer block counters of one policy."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every count."""
        self._kept: dict[int, torch.Tensor | int] = {}
        self._visible: dict[int, int] = {}
        self._loaded = {phase: {} for phase in PHASES}
        self._available = {phase: {} for phase in PHASES}
        self._estimate_k_loads: dict[int, int] = {}

    def add_compute(self, layer: int, kept: torch.Tensor | int, visible: int) -> None:
        """Prefill at ``layer`` kept ``kept`` (an int or a 0-dim device tensor, not synced) of
        ``visible`` causally visible sparse blocks (over heads)."""
        self._kept[layer] = self._kept.get(layer, 0) + kept
        self._visible[layer] = self._visible.get(layer, 0) + visible

    def add_comm(self, layer: int, is_prefill: bool, loaded: int, available: int) -> None:
        """``loaded`` of ``available`` CPU blocks were loaded (keys and values) at ``layer``."""
        phase = PHASES[0] if is_prefill else PHASES[1]
        self._loaded[phase][layer] = self._loaded[phase].get(layer, 0) + loaded
        self._available[phase][layer] = self._available[phase].get(layer, 0) + available

    def add_estimate_loads(self, layer: int, blocks: int) -> None:
        """``blocks`` key-only CPU block loads for estimation at ``layer``."""
        self._estimate_k_loads[layer] = self._estimate_k_loads.get(layer, 0) + blocks

    def to_dict(self, dense_prefill: bool) -> dict:
        """``{"prefill": {...}, "decode": {...}}`` of plain Python numbers (see
        ``LLMEngine.get_sparse_stats``); a density is None where nothing was counted.
        ``dense_prefill``: the policy attends to every visible key in prefill (density 1.0)."""
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
        prefill["estimate_k_loads"] = sum(self._estimate_k_loads.values())
        return {"prefill": prefill, "decode": self._comm("decode", sorted(self._available["decode"]))}

    def _comm(self, phase: str, layers: list[int]) -> dict:
        loaded, available = self._loaded[phase], self._available[phase]
        return {"comm_density": _ratio(sum(loaded.values()), sum(available.values())),
                "loaded_cpu_blocks": sum(loaded.values()), "available_cpu_blocks": sum(available.values()),
                "per_layer": [{"layer": i, "comm_density": _ratio(loaded.get(i, 0), available.get(i, 0))}
                              for i in layers]}
