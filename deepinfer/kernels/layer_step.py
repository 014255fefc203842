"""The ctypes side of layer_step.h: what the one-call layer stacks (decode_layers.py on GGUF
weights, bf16_layers.py on bf16 ones) share: a step's rows, the description of a stack and the
call that runs a step through it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels.kv_format import kv_format

i64, ptr = ctypes.c_int64, ctypes.c_void_p

# The tail of every stack's layer structure: its two norms (fp32 [hidden]) and their eps.
NORM_FIELDS = [
    ("attn_norm", ptr),
    ("ffn_norm", ptr),
    ("attn_eps", ctypes.c_float),
    ("ffn_eps", ctypes.c_float),
]


def norm_values(layer: object) -> tuple[int, int, float, float]:
    """NORM_FIELDS' values for a layer's weights (attn_norm, ffn_norm: fp32 tensors; their eps)."""
    return layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr(), layer.attn_eps, layer.ffn_eps


class _StackModel(ctypes.Structure):
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
    _fields_ += [("slot_stride", i64), ("kv_format", i64)]


@dataclass(slots=True)
class StepRows:
    """A step's attention inputs, as the paged backend prepared them (one row per token)."""

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, max_blocks] int64
    seq_lens: torch.Tensor  # [T] int64
    starts: torch.Tensor | None  # [T] int64, a sliding window's first position per row
    block_size: int


@dataclass(slots=True)
class StackAttention:
    """What a stack's attention takes from the model and the libraries: (query heads, kv heads,
    head dim), the rotary cos/sin tables (fp32 [P, head dim]), the softmax scale, and the addresses
    of rotary_rows, paged_write_kv, paged_attention_item, paged_decode_attention_merge and
    paged_attention_plan."""

    heads: tuple[int, int, int]
    tables: tuple[torch.Tensor, torch.Tensor]
    scale: float
    functions: tuple[int, int, int, int, int]


class LayerStack:
    """The layers of one model, described once to a stack's C function; `run` computes a step
    through all of them. Subclasses build the layer structures of their own weights."""

    dtype: torch.dtype  # of the hidden states a step takes and returns

    def __init__(
        self,
        function: ctypes._CFuncPtr,
        layers: ctypes.Array,
        keep: object,
        hidden: int,
        intermediate: int,
        attention: StackAttention,
    ) -> None:
        """`layers`: the C layer structures; `keep`: everything they point into."""
        function.argtypes = [ptr, ptr, ptr, ptr]
        function.restype = ctypes.c_int
        self._function, self._layers = function, layers
        self._keep = (keep, attention.tables)
        num_heads, num_kv_heads, head_dim = attention.heads
        cos, sin = attention.tables
        self._model = _StackModel(
            len(layers), hidden, intermediate, num_heads, num_kv_heads, head_dim, ctypes.addressof(layers),
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], attention.scale, *attention.functions,
        )  # fmt: skip

    def run(
        self, x: torch.Tensor, rows: StepRows, caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] embeddings in `dtype` -> (last layer's output, residual stream), new
        [T, hidden] tensors of that dtype; writes every layer's K/V into `caches` (one contiguous
        [slots, 2, kv heads, head dim] tensor per layer, all of one dtype the kernels read)."""
        h = x.clone()
        residual = torch.empty_like(x)
        kv = (ctypes.c_void_p * len(caches))(*(c.data_ptr() for c in caches))
        cache = caches[0]
        step = _Step(
            x.shape[0], rows.positions.data_ptr(), rows.slots.data_ptr(), rows.block_tables.data_ptr(),
            rows.seq_lens.data_ptr(), None if rows.starts is None else rows.starts.data_ptr(), rows.block_size,
            rows.block_tables.shape[1], ctypes.addressof(kv), cache.stride(1) * cache.element_size(),
            cache.stride(0), kv_format(cache.dtype),
        )  # fmt: skip
        status = self._function(
            ctypes.byref(self._model), ctypes.byref(step), h.data_ptr(), residual.data_ptr()
        )
        if status == -1:
            raise IndexError("a position is outside the rotary tables")
        if status:
            raise MemoryError("the layer stack could not allocate its buffers")
        return h, residual
