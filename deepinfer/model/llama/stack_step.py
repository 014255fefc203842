"""What the one-call layer stacks (llama/gguf_decode.py, llama/bf16_decode.py) take from a
model and a step: the attention's shapes, tables and library functions, the step's kernel rows,
and caches they can write. A step qualifies when the model has one cache group on the paged CPU
backend and every token of it is a kernel row of the decode attention."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.kernels.kv_format import KV_FORMATS
from deepinfer.kernels.layer_step import StackAttention, StepRows
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.model.layers.norm import RMSNorm


def stack_layers(
    layers: Sequence[torch.nn.Module],
) -> list[tuple[tuple[torch.nn.Module, ...], tuple[RMSNorm, RMSNorm]]] | None:
    """Each LlamaDecoderLayer's four projections (qkv, o, gate_up, down) and two norms, as a stack
    takes them; None for no layers or a layer with q/k norms (no stack computes those)."""
    if not layers or any(layer.self_attn.q_norm is not None for layer in layers):
        return None
    return [
        (
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj),
            (layer.input_layernorm, layer.post_attention_layernorm),
        )
        for layer in layers
    ]


def stack_attention(layers: Sequence[torch.nn.Module], backend: CpuPagedBackend) -> StackAttention | None:
    """The attention of LlamaDecoderLayers `layers` as a stack runs it: the first layer's heads,
    fp32 rotary tables and scale, and the rotary and paged-attention functions the PyTorch path
    calls (None without the row kernels)."""
    rowwise = rowwise_kernels()
    if rowwise is None:
        return None
    attn = layers[0].self_attn
    return StackAttention(
        (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        attn.rotary.tables(torch.device("cpu"), torch.float32),
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
    """Per-layer caches the C loop can write: contiguous [slots, 2, ...], one dtype the kernels read."""
    dtype = caches[0].dtype
    return dtype in KV_FORMATS and all(
        c.dtype is dtype and c.is_contiguous() and c.dim() == 4 and c.shape[1] == 2 for c in caches
    )
