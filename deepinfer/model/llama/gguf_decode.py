"""The Llama stack's layers in one C call (kernels/decode_layers.c) for the steps that allow it.

A model qualifies when every projection is packed GGUF without bias or q/k norms; a step, when
llama/stack_step.py's step_rows finds every token a kernel row of its decode attention (decodes
and short chunks, no long prefill chunk). That is every decode step of the default model; other
steps take the layer-by-layer PyTorch path, with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.kernels.decode_layers import DecodeStack, LayerWeights, decode_layers_library
from deepinfer.model.layers.gguf_linear import GGUFLinear
from deepinfer.model.llama.stack_step import stack_attention, stack_layers


def build_decode_stack(layers: Sequence[torch.nn.Module], backend: CpuPagedBackend) -> DecodeStack | None:
    """The stack of LlamaDecoderLayers `layers`, or None when one of them does not qualify."""
    lib, parts = decode_layers_library(), stack_layers(layers)
    if lib is None or parts is None:
        return None
    weights = []
    for linears, norms in parts:
        if not all(isinstance(m, GGUFLinear) and m.bias is None for m in linears):
            return None
        if not all(n.weight.dtype is torch.float32 and n.weight.is_contiguous() for n in norms):
            return None
        groups = [m.group for m in linears]
        weights.append(LayerWeights(*groups, norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps))
    attention = stack_attention(layers, backend)
    return None if attention is None else DecodeStack(lib, weights, attention)
