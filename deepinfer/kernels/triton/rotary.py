"""Rotary position embeddings in place, HF's "rotate half" layout (model/layers/rotary.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import next_power_of_2


@triton.jit
def _rotary_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr, num_heads,
    stride_xt, stride_xh, stride_table,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    i = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    i_ok = i < HALF
    ok = (h < num_heads)[:, None] & i_ok[None, :]
    # the tables hold [cos(p f), cos(p f)] per row: the first half is enough
    cos = tl.load(cos_ptr + pos * stride_table + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + token * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)  # [heads, half]
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, dim] in place (last axis contiguous); positions [T]; cos/sin [P, dim]."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary_ needs the head axis contiguous")
    if tokens:
        _rotary_kernel[(tokens,)](
            x, positions, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0),
            HALF=dim // 2, HALF_PAD=next_power_of_2(dim // 2), HEADS_PAD=next_power_of_2(heads),
        )  # fmt: skip
