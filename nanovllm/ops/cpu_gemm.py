"""float32 linear layers on the CPU through oneDNN, with each weight reordered once.

torch's ``F.linear`` runs MKL's sgemm over the plain ``[N, K]`` weight on every call. oneDNN's
linear reads a weight reordered once into its blocked layout: ``torch.ops.mkldnn._reorder_linear_weight``
then ``torch.ops.mkldnn._linear_pointwise``, the pair torch's inductor uses for frozen CPU models,
for decode's few rows and prefill's many alike. The weight is packed without a batch-size hint.
The comparison with sgemm and with hints: docs/ops.md, 'cpu_gemm.py'. The results differ from
sgemm's by float32 summation order only (greedy SmolLM2 tokens stay equal to transformers').
"""

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_state = {"usable": None}
"""Whether this torch build runs oneDNN's packed linear (None: not tried yet; False after a
failure, logged once, so every layer falls back to ``F.linear``)."""


def _onednn_usable() -> bool:
    if _state["usable"] is None:
        _state["usable"] = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return _state["usable"]


class PackedWeight:
    """The oneDNN-reordered copy of one float32 CPU weight ``[N, K]``, made on first use.

    Args:
        release_source: once packed, free the plain weight's storage (its shape and dtype stay;
            :meth:`unpack` brings the values back). Right for a layer's own weight, wrong for a
            weight something else reads (an LM head tied to the embedding), which is then kept
            and repacked whenever it is written (its version counter moves).
    """

    def __init__(self, release_source: bool):
        self.release_source = release_source
        self.packed: torch.Tensor | None = None
        self.version = -1

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for x ``[..., K]``: oneDNN over the packed weight for float32
        CPU tensors, else ``F.linear`` (over the unpacked weight if it had been released)."""
        if not (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and _onednn_usable()):
            self.unpack(weight)
            return F.linear(x, weight, bias)
        if self.packed is None or weight._version != self.version:
            if not self._pack(weight):
                return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _pack(self, weight: torch.Tensor) -> bool:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except RuntimeError as err:
            _state["usable"] = False
            logger.warning("oneDNN packed linear unavailable, CPU linears use F.linear: %s", err)
            return False
        self.packed = packed
        if self.release_source:
            weight.untyped_storage().resize_(0)
        self.version = weight._version
        return True

    def unpack(self, weight: torch.Tensor) -> None:
        """Make ``weight`` a plain, readable and writable tensor again (restoring a released
        source from the packed copy) and drop the packed copy; a no-op when nothing is packed.
        Call it before writing the weight (the layers' weight loaders do)."""
        if self.packed is None:
            return
        if self.release_source:
            weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            with torch.no_grad():
                weight.copy_(self.packed.to_dense())
        self.packed, self.version = None, -1
