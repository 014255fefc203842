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
        y = torch._int_mm(x_int8, self.weight_t).float()  # [M, out] int32 sums, exact
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
