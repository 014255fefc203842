"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.rowwise import fits, rowwise_kernels


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # Set by model/layers/device_kernels.py when the engine runs on the Triton backend; the
        # kernels are imported on use because Triton is an optional dependency.
        self.on_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_triton:
            from deepinfer.kernels.triton.rms_norm import rms_norm

            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        # fp32 CPU rows: one C call (F.rms_norm costs ~40 us per call on a few hundred values here,
        # and a batch-1 decode step makes 61 of them); otherwise the fused PyTorch op, which is
        # ~10x faster on CPU than the pow/mean/rsqrt/mul chain.
        kernels = rowwise_kernels()
        if kernels is not None and fits(x) and fits(self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)[0]
        if kernels is not None and x.dtype is torch.bfloat16 and x.is_cpu:
            # bf16 rows normalized in fp32 by the kernel and rounded once, as F.rms_norm does in
            # bf16, at less call overhead (~1.5x faster on a decode row, even at 32 rows).
            return kernels.rms_norm(x.float(), self.weight.float(), self.eps)[0].to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual)."""
        if self.on_triton and x.dim() == 2 and x.shape == residual.shape:
            from deepinfer.kernels.triton.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        kernels = rowwise_kernels()
        if (
            kernels is not None
            and fits(x)
            and fits(residual)
            and fits(self.weight)
            and x.shape == residual.shape
        ):
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        residual = x + residual
        return self(residual), residual
