"""DeepSeek-V4's RMSNorms: float32 weights and float32 arithmetic, one cast back at the end."""

from __future__ import annotations

import torch


class Fp32RMSNorm(torch.nn.Module):
    """weight * x / rms(x), computed in float32 whatever the activations' dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim (the query heads' and the mHC input's norm have no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
