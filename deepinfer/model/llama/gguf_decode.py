"""The Llama stack's layers in one C call (kernels/decode_layers.c) for the steps that allow it.

A step qualifies when every projection is packed GGUF without bias or q/k norms, the model has
one cache group, the backend is the paged CPU one and every token of the step is a kernel row
of its decode attention (decodes and short chunks, no long prefill chunk). That is every decode
step of the default model; other steps take the layer-by-layer PyTorch path, with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.kernels.decode_layers import DecodeStack, LayerWeights, StepRows, decode_layers_library
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.model.layers.gguf_linear import GGUFLinear


def build_decode_stack(layers: Sequence[torch.nn.Module], backend: CpuPagedBackend) -> DecodeStack | None:
    """The stack of LlamaDecoderLayers `layers`, or None when one of them does not qualify."""
    lib, rowwise = decode_layers_library(), rowwise_kernels()
    if lib is None or rowwise is None or not layers:
        return None
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, GGUFLinear) and m.bias is None for m in linears) or attn.q_norm is not None:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(n.weight.dtype is torch.float32 and n.weight.is_contiguous() for n in norms):
            return None
        weights.append(
            LayerWeights(
                attn.qkv_proj.group,
                attn.o_proj.group,
                mlp.gate_up_proj.group,
                mlp.down_proj.group,
                norms[0].weight,
                norms[0].eps,
                norms[1].weight,
                norms[1].eps,
            )
        )
    attn = layers[0].self_attn
    tables = attn.rotary.tables(torch.device("cpu"), torch.float32)
    return DecodeStack(
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


def step_rows(
    h: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata, dtype: torch.dtype
) -> StepRows | None:
    """The step's attention rows when every token is a kernel row in order and h [T, hidden] is
    contiguous in the stack's dtype, else None."""
    if len(meta.groups) != 1 or h.dim() != 2 or h.dtype is not dtype or not h.is_contiguous():
        return None
    group = meta.groups[0]
    extra = group.extra
    if extra.get("kernel_rows") != h.shape[0] or extra["kernel_tokens"] is not None or extra["long_chunks"]:
        return None
    tensors = (positions, group.slot_mapping, extra["kernel_tables"], extra["kernel_lens"])
    if not all(t.dtype is torch.int64 and t.is_contiguous() for t in tensors):
        return None
    return StepRows(*tensors, extra["kernel_starts"], group.block_size)


def caches_fit(caches: Sequence[torch.Tensor]) -> bool:
    """Per-layer caches the C loop can write: contiguous [slots, 2, ...], one dtype, fp32 or fp16."""
    dtype = caches[0].dtype
    return dtype in (torch.float32, torch.float16) and all(
        c.dtype is dtype and c.is_contiguous() and c.dim() == 4 and c.shape[1] == 2 for c in caches
    )
