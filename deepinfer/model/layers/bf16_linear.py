"""bf16 linear layers on the CPU's own kernel (kernels/bf16_matmul.c) instead of torch's GEMM.

torch's bf16 GEMM (oneDNN) gives a row other bits depending on the rows that come with it, so a
request's greedy output could change with the batch; the kernel sums every output in one fixed
order, and at batch 1 streams the weights once. The layer keeps only the kernel's packed copy
of its weight (a tied LM head's embedding stays for the lookups).
"""

from __future__ import annotations

import torch

from deepinfer.kernels.bf16_matmul import Bf16Kernels, fits, pack


class Bf16Linear(torch.nn.Module):
    """y = bf16(x W^T + b) for bf16 x [..., in]; W bf16 [out, in] kept packed, b kept in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Bf16Kernels) -> None:
        super().__init__()
        self.register_buffer("packed", pack(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x.to(torch.bfloat16), self.packed, self.out_features, self.bias)


def use_bf16_kernels_(module: torch.nn.Module, kernels: Bf16Kernels) -> int:
    """Replace, in place, every nn.Linear below `module` whose weight the kernel takes (bf16,
    CPU, contiguous) by a Bf16Linear of it; returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) and fits(child.weight):
            setattr(module, name, Bf16Linear(child.weight, child.bias, kernels))
            replaced += 1
        else:
            replaced += use_bf16_kernels_(child, kernels)
    return replaced
