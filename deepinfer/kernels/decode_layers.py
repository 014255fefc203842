"""ctypes binding of decode_layers.c: every layer of a Llama stack on packed GGUF weights in one
call, for steps whose rows all go through the paged decode-attention kernel.

The caller describes the stack once (`DecodeStack`): its packed groups and norms, and what its
attention takes (`layer_step.StackAttention`: the rotary tables and the addresses of the rotary,
K/V-write and attention functions of the libraries the PyTorch path calls), so both paths run
the same code on the same bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library
from deepinfer.kernels.gguf_blocks import PackedGroup
from deepinfer.kernels.layer_step import NORM_FIELDS, LayerStack, StackAttention, norm_values

_FLAGS = ("-ffp-contract=off",)  # gguf_matmul.c's own: the products must match its library's bits
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Group(ctypes.Structure):
    _fields_ = [("count", i64), ("rows", i64), ("qtypes", ptr), ("weights", ptr), ("row_counts", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Group), ("o", _Group), ("gate_up", _Group), ("down", _Group), *NORM_FIELDS]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer: its four packed projections and two norms (weights fp32 [hidden])."""

    qkv: PackedGroup
    o: PackedGroup
    gate_up: PackedGroup
    down: PackedGroup
    attn_norm: torch.Tensor
    attn_eps: float
    ffn_norm: torch.Tensor
    ffn_eps: float


def _group(g: PackedGroup) -> _Group:
    return _Group(g.count, g.rows, g.qtypes, g.pointers, g.row_counts)


class DecodeStack(LayerStack):
    """A Llama stack on packed GGUF weights (decode_layers.c); fp32 hidden states."""

    dtype = torch.float32

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[LayerWeights], attention: StackAttention) -> None:
        structures = (_Layer * len(layers))(
            *(_Layer(*map(_group, (w.qkv, w.o, w.gate_up, w.down)), *norm_values(w)) for w in layers)
        )
        first = layers[0]
        super().__init__(
            lib.decode_layers, structures, list(layers), first.qkv.cols, first.down.cols, attention
        )


def decode_layers_library() -> ctypes.CDLL | None:
    """The compiled library for kernels/isa.py's level; None without a C compiler."""
    return load_kernel_library("decode_layers", _FLAGS, isa.compiler_flags())
