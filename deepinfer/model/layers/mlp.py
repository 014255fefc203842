"""The SwiGLU feed-forward block with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate_up_proj holds the gate rows then the up rows.

    With `swiglu_limit` (DeepSeek-V4), gate is clamped from above and up to [-limit, limit] first."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = torch.nn.Parameter(
            torch.empty(2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = torch.nn.Parameter(torch.empty(hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return F.linear(swiglu(gate, up, self.swiglu_limit), self.down_proj)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
