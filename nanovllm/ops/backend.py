"""Which path an op takes: Triton (when installed) for CUDA tensors, or for CPU tensors under
Triton's interpreter; torch otherwise.

Without Triton (CPU-only installs, macOS, Windows) ``triton.jit`` is a stand-in that returns the
function unchanged, in both forms ``@triton.jit`` and ``@triton.jit(do_not_specialize=...)``, and
``tl.constexpr`` a placeholder, so the kernel modules still import; :func:`use_triton` is then
always False and no kernel is launched.
"""

import os
import types

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:

    def _jit_stand_in(fn=None, **_options):
        """``triton.jit`` without Triton: the function itself, decorated bare or with options."""
        return fn if fn is not None else _jit_stand_in

    triton = types.SimpleNamespace(jit=_jit_stand_in)
    tl = types.SimpleNamespace(constexpr=None)
    HAS_TRITON = False

INTERPRET_ENV = "NANOVLLM_TRITON_INTERPRET"
"""Set to "1" (together with TRITON_INTERPRET=1 before Triton is imported) to run the Triton
kernels on CPU tensors through Triton's interpreter; the tests use it. The interpreter computes
bfloat16 ``tl.dot`` wrongly (numpy has no bfloat16), so use float16/float32 inputs there."""


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should handle ``tensor``: a CUDA tensor, or a CPU tensor while
    both ``NANOVLLM_TRITON_INTERPRET=1`` and ``TRITON_INTERPRET=1`` are set. False without Triton."""
    if not HAS_TRITON:
        return False
    if tensor.is_cuda:
        return True
    return os.environ.get(INTERPRET_ENV) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def interpreted(tensor: torch.Tensor) -> bool:
    """True when the Triton path for ``tensor`` runs under Triton's interpreter (a CPU tensor):
    nothing is compiled there, and every tile element costs numpy work."""
    return not tensor.is_cuda
