"""SwiGLU (Shazeer, 2020), ``silu(gate) * up`` of a packed ``[gate, up]`` projection, in one launch.

The torch form ``F.silu(gate).mul_(up)`` is two elementwise kernels per layer; on a decode step of a
small model each costs more in launch than in bytes. The fused kernel reads gate and up once and
writes the product, computed in float32 and rounded once to the input dtype (the torch form of a
bfloat16/float16 input rounds twice: the silu, then the product).
"""

import torch
import torch.nn.functional as F

from nanovllm.utils.ints import cdiv

from ._triton import next_pow2
from .backend import tl, triton, use_triton

MAX_BLOCK = 1024
"""Widest column tile of one program: a row of d columns takes ``cdiv(d, tile)`` programs."""
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_args(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"expected x [T, 2 * d] (gate and up halves); got x {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`silu_and_mul` (same argument and result): float32 math (float64 for a
    float64 input), rounded once to x's dtype."""
    _check_args(x)
    gate, up = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, -1)
    return (F.silu(gate) * up).to(x.dtype)


def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The two-kernel torch form: silu in x's dtype, then the product in x's dtype."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_xt, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one token row; grid axis 1 tiles its d columns
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate_ptr = x_ptr + t * stride_xt + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + d, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` (SwiGLU's gating, as vLLM's ``SiluAndMul``).

    Args:
        x: ``[T, 2 * d]``, the gate and up projections side by side; any row stride;
            float16/bfloat16/float32 for the kernel.

    Returns:
        ``[T, d]``, contiguous, x's dtype.

    Raises:
        ValueError: x not 2-D or its last dimension odd.

    CUDA (float16/bfloat16/float32, contiguous last dimension): one Triton launch over a grid of
    (T, column tiles), float32 math rounded once, as :func:`silu_and_mul_ref`. The tile is sized
    from d alone and T is no kernel argument, so one compiled variant serves every batch size.
    Elsewhere (CPU, float64, a strided last dimension): torch's ``F.silu(gate).mul_(up)``, which
    for float32 equals the reference and for bfloat16/float16 rounds twice (within one rounding
    step of the reference, about one unit in the last place).
    """
    _check_args(x)
    if not use_triton(x) or x.dtype not in KERNEL_DTYPES or x.stride(-1) != 1:
        return _silu_and_mul_torch(x)
    tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, d, dtype=x.dtype, device=x.device)
    if tokens and d:
        block = min(MAX_BLOCK, next_pow2(d))
        _silu_and_mul_kernel[(tokens, cdiv(d, block))](x, out, d, x.stride(0), BLOCK=block, num_warps=4)
    return out
