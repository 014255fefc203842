"""ctypes binding of bf16_layers.c: every layer of a Llama stack on bf16 weights (our bf16 kernel)
in one call, for steps whose rows all go through the paged decode-attention kernel.

The caller describes the stack once (`Bf16Stack`): each layer's packed projections and fp32
norms, the rotary tables, and the addresses of the rotary, K/V-write and attention functions of
the libraries the PyTorch path calls, so both paths run the same code on the same bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library
from deepinfer.kernels.decode_layers import StepRows, run_stack

_FLAGS = ("-ffp-contract=off",)  # bf16_matmul.c's own: the products must match its library's bits
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Weight(ctypes.Structure):
    _fields_ = [("packed", ptr), ("bias", ptr), ("n", i64), ("k", i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight)]
    _fields_ += [
        ("attn_norm", ptr),
        ("ffn_norm", ptr),
        ("attn_eps", ctypes.c_float),
        ("ffn_eps", ctypes.c_float),
    ]


class _Model(ctypes.Structure):
    _fields_ = [(name, i64) for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads")]
    _fields_ += [
        ("head_dim", i64),
        ("layers", ptr),
        ("cos_table", ptr),
        ("sin_table", ptr),
        ("table_rows", i64),
    ]
    _fields_ += [("scale", ctypes.c_float), ("rotary", ptr), ("write_kv", ptr)]
    _fields_ += [("attend_item", ptr), ("attend_merge", ptr), ("attend_plan", ptr)]


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


class Bf16Stack:
    """The layers of one bf16 model, described once; `run` computes a step through all of them."""

    dtype = torch.bfloat16  # of the hidden states it takes and returns

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: Sequence[Bf16LayerWeights],
        heads: tuple[int, int, int],
        tables: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        functions: tuple[int, int, int, int, int],
    ) -> None:
        """heads: (query heads, kv heads, head dim); tables: rotary cos/sin, fp32 [P, head dim];
        functions: addresses of rotary_rows, paged_write_kv, paged_attention_item,
        paged_decode_attention_merge and paged_attention_plan."""
        self._run = lib.bf16_layers
        self._run.argtypes = [ptr, ptr, ptr, ptr]
        self._run.restype = ctypes.c_int
        self._keep = (list(layers), tables)  # everything the structures point into
        first = layers[0]
        self._layers = (_Layer * len(layers))(
            *(
                _Layer(
                    _weight(w.qkv),
                    _weight(w.o),
                    _weight(w.gate_up),
                    _weight(w.down),
                    w.attn_norm.data_ptr(),
                    w.ffn_norm.data_ptr(),
                    w.attn_eps,
                    w.ffn_eps,
                )
                for w in layers
            )
        )
        num_heads, num_kv_heads, head_dim = heads
        cos, sin = tables
        self._model = _Model(
            len(layers), first.qkv.k, first.down.k, num_heads, num_kv_heads, head_dim,
            ctypes.addressof(self._layers), cos.data_ptr(), sin.data_ptr(), cos.shape[0], scale, *functions,
        )  # fmt: skip

    def run(
        self, x: torch.Tensor, rows: StepRows, caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] bf16 embeddings -> (last layer's output, residual stream), both bf16
        [T, hidden]; writes every layer's K/V into `caches` (one contiguous [slots, 2, kv heads,
        head dim] tensor per layer, all fp16 or all fp32)."""
        return run_stack(self._run, self._model, x, rows, caches)


def bf16_layers_library() -> ctypes.CDLL | None:
    """The compiled library for kernels/isa.py's level; None without a C compiler."""
    return load_kernel_library("bf16_layers", _FLAGS, isa.compiler_flags())
