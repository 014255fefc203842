"""ctypes binding of decode_layers.c: every layer of a Llama stack on packed GGUF weights in one
call, for steps whose rows all go through the paged decode-attention kernel.

The caller describes the stack once (`DecodeStack`): its packed groups and norms, the rotary
tables, and the addresses of the rotary, K/V-write and attention functions of the libraries the
PyTorch path calls, so both paths run the same code on the same bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library
from deepinfer.kernels.gguf_blocks import PackedGroup

_FLAGS = ("-ffp-contract=off",)  # gguf_matmul.c's own: the products must match its library's bits
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Group(ctypes.Structure):
    _fields_ = [("count", i64), ("rows", i64), ("qtypes", ptr), ("weights", ptr), ("row_counts", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Group), ("o", _Group), ("gate_up", _Group), ("down", _Group)]
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


class _Step(ctypes.Structure):
    _fields_ = [("rows", i64), ("positions", ptr), ("slots", ptr), ("block_tables", ptr), ("seq_lens", ptr)]
    _fields_ += [("starts", ptr), ("block_size", i64), ("max_blocks", i64), ("kv", ptr), ("v_offset", i64)]
    _fields_ += [("slot_stride", i64), ("kv_half", i64)]


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


@dataclass(slots=True)
class StepRows:
    """A step's attention inputs, as the paged backend prepared them (one row per token)."""

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, max_blocks] int64
    seq_lens: torch.Tensor  # [T] int64
    starts: torch.Tensor | None  # [T] int64, a sliding window's first position per row
    block_size: int


def _group(g: PackedGroup) -> _Group:
    return _Group(g.count, g.rows, g.qtypes, g.pointers, g.row_counts)


class DecodeStack:
    """The layers of one model, described once; `run` computes a step through all of them."""

    dtype = torch.float32  # of the hidden states it takes and returns

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: Sequence[LayerWeights],
        heads: tuple[int, int, int],
        tables: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        functions: tuple[int, int, int, int, int],
    ) -> None:
        """heads: (query heads, kv heads, head dim); tables: rotary cos/sin, fp32 [P, head dim];
        functions: addresses of rotary_rows, paged_write_kv, paged_attention_item,
        paged_decode_attention_merge and paged_attention_plan."""
        self._run = lib.decode_layers
        self._run.argtypes = [ptr, ptr, ptr, ptr]
        self._run.restype = ctypes.c_int
        self._keep = (list(layers), tables)  # everything the structures point into
        first = layers[0]
        self.hidden = first.qkv.cols
        self._layers = (_Layer * len(layers))(
            *(
                _Layer(
                    _group(w.qkv),
                    _group(w.o),
                    _group(w.gate_up),
                    _group(w.down),
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
            len(layers), self.hidden, first.down.cols, num_heads, num_kv_heads, head_dim,
            ctypes.addressof(self._layers), cos.data_ptr(), sin.data_ptr(), cos.shape[0], scale, *functions,
        )  # fmt: skip

    def run(
        self, x: torch.Tensor, rows: StepRows, caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] fp32 embeddings -> (last layer's output, residual stream), both
        [T, hidden]; writes every layer's K/V into `caches` (one contiguous [slots, 2, kv
        heads, head dim] tensor per layer, all of one dtype)."""
        return run_stack(self._run, self._model, x, rows, caches)


def run_stack(
    function: ctypes._CFuncPtr,
    model: ctypes.Structure,
    x: torch.Tensor,
    rows: StepRows,
    caches: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step through a layer stack's C function (decode_layers, bf16_layers): x [T, hidden]
    -> (last layer's output, residual stream), new tensors of x's dtype; K/V written to `caches`."""
    h = x.clone()
    residual = torch.empty_like(x)
    kv = (ctypes.c_void_p * len(caches))(*(c.data_ptr() for c in caches))
    cache = caches[0]
    step = _Step(
        x.shape[0], rows.positions.data_ptr(), rows.slots.data_ptr(), rows.block_tables.data_ptr(),
        rows.seq_lens.data_ptr(), None if rows.starts is None else rows.starts.data_ptr(), rows.block_size,
        rows.block_tables.shape[1], ctypes.addressof(kv), cache.stride(1) * cache.element_size(),
        cache.stride(0), int(cache.dtype == torch.float16),
    )  # fmt: skip
    status = function(ctypes.byref(model), ctypes.byref(step), h.data_ptr(), residual.data_ptr())
    if status == -1:
        raise IndexError("a position is outside the rotary tables")
    if status:
        raise MemoryError("the layer stack could not allocate its buffers")
    return h, residual


def decode_layers_library() -> ctypes.CDLL | None:
    """The compiled library for kernels/isa.py's level; None without a C compiler."""
    return load_kernel_library("decode_layers", _FLAGS, isa.compiler_flags())
