"""The Llama stack's layers in one C call on bf16 weights (kernels/bf16_layers.c), for the steps
that allow it.

A model qualifies when every projection computes with a Bf16Linear (our bf16 kernel) on one rank,
with no q/k norms;
a step, as for the GGUF stack (llama/gguf_decode.py), when it has one cache group on the paged
CPU backend and every token is a kernel row of its decode attention (for a bf16 model, every
step: its prompt rows are kernel rows too). Other steps take the layer-by-layer path, with the
same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.kernels.bf16_layers import Bf16LayerWeights, Bf16Projection, Bf16Stack, bf16_layers_library
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.model.layers.bf16_linear import Bf16Linear
from deepinfer.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear


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
    lib, rowwise = bf16_layers_library(), rowwise_kernels()
    if lib is None or rowwise is None or not layers:
        return None
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_bf16_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(m is None for m in linears) or attn.q_norm is not None:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        weights.append(
            Bf16LayerWeights(
                *(_projection(m) for m in linears),
                norms[0].weight.detach().float().contiguous(),  # widened as RMSNorm widens it per call
                norms[0].eps,
                norms[1].weight.detach().float().contiguous(),
                norms[1].eps,
            )
        )
    attn = layers[0].self_attn
    tables = attn.rotary.tables(torch.device("cpu"), torch.float32)
    return Bf16Stack(
        lib,
        weights,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        tables,
        attn.scale,
        (
            rowwise.rotary_address,
            backend.write_kv_address,
            backend.decode_item_address,
            backend.decode_merge_address,
            backend.decode_plan_address,
        ),
    )
