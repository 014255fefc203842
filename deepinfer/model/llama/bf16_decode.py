"""The Llama stack's layers in one C call on bf16 weights (kernels/bf16_layers.c), for the steps
that allow it.

A model qualifies when every projection computes with a Bf16Linear (our bf16 kernel) on one rank,
with no q/k norms; a step, as for the GGUF stack, when llama/stack_step.py's step_rows finds every
token a kernel row of its decode attention (for a bf16 model, every step: its prompt rows are
kernel rows too). Other steps take the layer-by-layer path, with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.kernels.bf16_layers import Bf16LayerWeights, Bf16Projection, Bf16Stack, bf16_layers_library
from deepinfer.model.layers.bf16_linear import Bf16Linear
from deepinfer.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deepinfer.model.llama.stack_step import stack_attention, stack_layers


def _bf16_linear(projection: torch.nn.Module) -> Bf16Linear | None:
    """The Bf16Linear a one-rank projection computes with, else None (the stack has no all-reduce)."""
    if isinstance(projection, RowParallelLinear) and projection.tp.size != 1:
        return None
    linear = (
        projection.linear if isinstance(projection, (ColumnParallelLinear, RowParallelLinear)) else projection
    )
    return linear if isinstance(linear, Bf16Linear) else None


def _projection(linear: Bf16Linear) -> Bf16Projection:
    return Bf16Projection(linear.packed, linear.bias, linear.out_features, linear.in_features)


def build_bf16_stack(layers: Sequence[torch.nn.Module], backend: CpuPagedBackend) -> Bf16Stack | None:
    """The stack of LlamaDecoderLayers `layers` on Bf16Linear projections, or None when one of
    them does not qualify."""
    lib, parts = bf16_layers_library(), stack_layers(layers)
    if lib is None or parts is None:
        return None
    weights = []
    for projections, (first, second) in parts:
        linears = [_bf16_linear(m) for m in projections]
        if any(m is None for m in linears):
            return None
        # the norms' weights widened once, as RMSNorm widens them at every call
        attn_norm, ffn_norm = (n.weight.detach().float().contiguous() for n in (first, second))
        weights.append(
            Bf16LayerWeights(*map(_projection, linears), attn_norm, first.eps, ffn_norm, second.eps)
        )
    attention = stack_attention(layers, backend)
    return None if attention is None else Bf16Stack(lib, weights, attention)
