"""W8A8 linear layers for the CPU: int8 weights per output channel, int8 activations per token.

On a CPU with int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI) an int8 GEMM runs several
times faster than fp32 and reads a quarter of the weight bytes, which is what batch-1 decoding is
bound by. Activations get one scale per token (row), computed at run time, so a row's result never
depends on the other rows of the batch: the integer products are exact, and greedy outputs stay
identical across batch compositions, as in fp32. Accuracy is that of symmetric int8 with per-token
and per-channel scales (no outlier handling), adequate for small models; it is an opt-in mode.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# A product of two int8 values is at most 127 * 127 in magnitude, so a sum of up to 1040 of them
# stays below 2**24, where every integer is an fp32: an fp32 GEMM over that many columns is exact
# in any summation order, as the int32 one is.
EXACT_FP32_COLUMNS = 1040
# From this many rows the exact fp32 GEMM (chunks of EXACT_FP32_COLUMNS) is used instead of
# torch._int_mm, which the CPU build of torch 2.13 runs at ~2.4 GOP/s whatever the shape (a
# 4,096-token prompt took 409 s); at one row both take ~0.8 ms for 576x1536, and the int8 one
# reads a quarter of the weight bytes.
FP32_GEMM_ROWS = 2


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 [M, N], exact (the same integers on either path)."""
    if a.shape[0] < FP32_GEMM_ROWS or torch.get_float32_matmul_precision() != "highest":
        return torch._int_mm(a, b)
    out: torch.Tensor | None = None
    for k in range(0, a.shape[1], EXACT_FP32_COLUMNS):
        part = (a[:, k : k + EXACT_FP32_COLUMNS].float() @ b[k : k + EXACT_FP32_COLUMNS].float()).to(
            torch.int32
        )
        out = part if out is None else out.add_(part)
    assert out is not None
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], scale [M, 1]) with x ~= int8 * scale, symmetric per row."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / INT8_MAX
    return (x / scale).round_().to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 [in, out] (the layout the int8 GEMM takes) and a float
    scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w_int8, w_scale = quantize_rows(weight.detach().float())  # per output channel
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_t", w_int8.t().contiguous())  # [in, out]
        self.register_buffer("weight_scale", w_scale.view(1, -1))  # [1, out]
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, layer: torch.nn.Linear) -> Int8Linear:
        return cls(layer.weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_int8, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        y = int8_matmul(x_int8, self.weight_t).float()  # [M, out] int32 sums, exact
        y.mul_(x_scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features)


def quantize_linears_(module: torch.nn.Module) -> None:
    """Replace every nn.Linear below `module` by an Int8Linear, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            quantize_linears_(child)
