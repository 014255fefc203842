"""RMSNorm fused with the residual add before it: one read of x and the residual, two writes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_out, stride_sum, stride_x, stride_res,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the activations' dtype before the norm reads it, as the
        # unfused `x + residual` in the model's dtype does
        x = x + tl.load(residual_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (and residual) [N, hidden] -> (norm(x + residual) * weight, x + residual); without a
    residual the second value is x itself."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            out, total, x, x if residual is None else residual, weight, eps,
            out.stride(0), total.stride(0), x.stride(0), (x if residual is None else residual).stride(0),
            HIDDEN=hidden, BLOCK=next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out, total
