"""ctypes binding of bf16_layers.c: every layer of a Llama stack on bf16 weights (our bf16 kernel)
in one call, for steps whose rows all go through the paged decode-attention kernel.

The caller describes the stack once (`Bf16Stack`): each layer's packed projections and fp32
norms, and what its attention takes (`layer_step.StackAttention`), so both paths run the same
code on the same bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library
from deepinfer.kernels.layer_step import NORM_FIELDS, LayerStack, StackAttention, norm_values

_FLAGS = ("-ffp-contract=off",)  # bf16_matmul.c's own: the products must match its library's bits
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Weight(ctypes.Structure):
    _fields_ = [("packed", ptr), ("bias", ptr), ("n", i64), ("k", i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight), *NORM_FIELDS]


@dataclass(slots=True)
class Bf16Projection:
    """A projection as the kernel holds it: W [n, k] packed (bf16_matmul.py's pack), bias fp32 [n]."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


@dataclass(slots=True)
class Bf16LayerWeights:
    """One decoder layer: its four projections and two norms (weights fp32 [hidden])."""

    qkv: Bf16Projection
    o: Bf16Projection
    gate_up: Bf16Projection
    down: Bf16Projection
    attn_norm: torch.Tensor
    attn_eps: float
    ffn_norm: torch.Tensor
    ffn_eps: float


def _weight(p: Bf16Projection) -> _Weight:
    return _Weight(p.packed.data_ptr(), None if p.bias is None else p.bias.data_ptr(), p.n, p.k)


class Bf16Stack(LayerStack):
    """A Llama stack on bf16 weights (bf16_layers.c); bf16 hidden states."""

    dtype = torch.bfloat16

    def __init__(
        self, lib: ctypes.CDLL, layers: Sequence[Bf16LayerWeights], attention: StackAttention
    ) -> None:
        structures = (_Layer * len(layers))(
            *(_Layer(*map(_weight, (w.qkv, w.o, w.gate_up, w.down)), *norm_values(w)) for w in layers)
        )
        first = layers[0]
        super().__init__(lib.bf16_layers, structures, list(layers), first.qkv.k, first.down.k, attention)


def bf16_layers_library() -> ctypes.CDLL | None:
    """The compiled library for kernels/isa.py's level; None without a C compiler."""
    return load_kernel_library("bf16_layers", _FLAGS, isa.compiler_flags())
