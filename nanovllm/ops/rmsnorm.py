"""RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add, in one launch.

Decode steps of small models are bound by kernel count, not bytes: the plain torch form of an
RMSNorm with its residual add is about nine elementwise and reduction kernels. The fused kernel
reads each row once and writes the normalised row (and the new residual).

Numerics follow transformers' ``LlamaRMSNorm`` step for step: the residual sum rounded to the
input dtype, the normalisation in float32, the result rounded to the input dtype, then multiplied
by the weight and rounded again.
"""

import torch
import torch.nn.functional as F

from ._triton import next_pow2
from .backend import tl, triton, use_triton


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() not in (2, 3) or weight.shape != (x.shape[-1],):
        raise ValueError(f"expected x [T, H] or [T, heads, H] and weight [H]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Reference of :func:`rms_norm` (same arguments and results)."""
    _check_args(x, weight, residual)
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    out = weight * normed
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, num_heads, dim, eps,
    stride_xt, stride_xh, stride_rt, stride_rh,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of the contiguous output
    t, h = row // num_heads, row % num_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + h * stride_rh + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * dim + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, after ``x += residual``.

    Args:
        x: ``[T, H]`` or ``[T, heads, H]`` (e.g. per-head q/k norm of a strided q view); the last
            dimension contiguous; float16/bfloat16/float32.
        weight: ``[H]``, same dtype as x. eps: added to the mean square.
        residual: optional, x's shape and dtype.

    Returns:
        ``out`` (contiguous, x's shape and dtype), or ``(out, x + residual)`` with a residual.

    Raises:
        ValueError: x not 2-D/3-D, weight not ``[H]``, residual of another shape.

    CUDA: one Triton program per row (per token, or per token and head). CPU, float32: torch's
    ``F.rms_norm`` (one call instead of the reference's seven; the same float32 math, equal to the
    reference bit for bit); other dtypes: :func:`rms_norm_ref` (it rounds the normalised row to
    the input dtype before the weight, as transformers does).
    """
    _check_args(x, weight, residual)
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not use_triton(x):
        summed = x if residual is None else x + residual
        out = F.rms_norm(summed, (x.shape[-1],), weight, eps)
        return out if residual is None else (out, summed)
    if not use_triton(x) or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        return rms_norm_ref(x, weight, eps, residual)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual.unsqueeze(1))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    tokens, heads, dim = x3.shape
    if tokens * heads:
        _rms_norm_kernel[(tokens * heads,)](
            x3, r3, weight, out, res_out, heads, dim, eps,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(dim), num_warps=4 if dim <= 4096 else 8,
        )
    return out if residual is None else (out, res_out)
