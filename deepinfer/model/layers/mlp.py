"""The SwiGLU feed-forward block with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.layers.fp8_linear import linear
from deepinfer.model.layers.parallel_linear import Segment
from deepinfer.model.parallel import SINGLE, TensorParallel


class GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate_up_proj holds the gate rows then the up rows.

    Under tensor parallelism a rank holds its share of the intermediate dimension (`columns`):
    its output is a partial sum, reduced over the group here, or (`reduce=False`) by the caller
    together with other partial sums. With `swiglu_limit` (DeepSeek-V4), gate is clamped from
    above and up to [-limit, limit] first."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel = SINGLE,
        reduce: bool = True,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.columns = Segment.even(intermediate_size, tp)
        self.tp = tp if reduce else SINGLE
        self.intermediate_size = self.columns.local
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = torch.nn.Parameter(
            torch.empty(2 * self.columns.local, hidden_size), requires_grad=False
        )
        self.down_proj = torch.nn.Parameter(torch.empty(hidden_size, self.columns.local), requires_grad=False)
        self.splits = {"gate_up_proj": (0, [self.columns, self.columns]), "down_proj": (1, [self.columns])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # either projection may be kept in FP8 (layers/fp8_linear.py)
        gate, up = linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(linear(swiglu(gate, up, self.swiglu_limit), self.down_proj))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
