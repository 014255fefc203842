"""Products and row lookups on GGUF-packed weights, through the C kernel gguf_matmul.c.

A `PackedMatrix` is a weight matrix in the file's own blocks (a view of the memory-mapped file
when nothing had to be reordered), or, where its rows are a multiple of eight, the same blocks with
every eight rows interleaved (`GGUFKernels.interleave`: a copy the size of the file's, computed on
1.3-3x faster (deepinfer/bench/gguf_kernels.py), with the same bits). A `PackedGroup` is one or more of them with the same number of
columns, multiplied as if their rows were concatenated (fused q/k/v, gate/up), each in its own
format, in one kernel call. The numerics are described at the top of gguf_matmul.c.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library

log = logging.getLogger(__name__)

# ggml type ids of the formats the kernel computes on directly.
PACKED_TYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
}  # fmt: skip
_FLAGS = ("-ffp-contract=off",)
_PROLOGUE_NONE, _PROLOGUE_RMS_NORM, _PROLOGUE_SWIGLU = 0, 1, 2  # as in gguf_matmul.c
_PATH_PORTABLE, _PATH_VECTOR, _PATH_TILES = 0, 1, 2  # gguf_matmul's simd, as in gguf_matmul.c


# Our ids of the formats with every eight rows interleaved (gguf_matmul.c's block_q4_0x8 and kin):
# what the kernels compute fastest on; the same bytes, rearranged.
INTERLEAVED_TYPES = {
    f"{name}_X8": 100 + PACKED_TYPES[name]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
}


@dataclass(slots=True)
class PackedMatrix:
    qtype: int  # ggml type id, one of PACKED_TYPES, or one of INTERLEAVED_TYPES
    rows: int
    cols: int
    data: np.ndarray  # uint8 [rows, bytes per row], C-contiguous (interleaved: the same bytes, moved)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class GGUFKernels:
    """The compiled library for one target (default: this machine's instruction set)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.gguf_matmul.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
        lib.gguf_matmul.argtypes += [ctypes.c_int, ptr, ptr, ptr, ctypes.c_float]  # the prologue
        lib.gguf_matmul.restype = None
        lib.gguf_scratch_bytes.argtypes = [i64, i64, i64, ptr]
        lib.gguf_scratch_bytes.restype = i64
        lib.gguf_dequantize_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr]
        lib.gguf_dequantize_rows.restype = None
        lib.gguf_block_bytes.argtypes = [ctypes.c_int]
        lib.gguf_block_bytes.restype = i64
        lib.gguf_block_elems.argtypes = [ctypes.c_int]
        lib.gguf_simd_level.restype = ctypes.c_int
        lib.gguf_amx_ready.restype = ctypes.c_int
        lib.gguf_interleaved_type.argtypes = [ctypes.c_int, i64, i64]
        lib.gguf_interleaved_type.restype = ctypes.c_int
        lib.gguf_interleave.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
        lib.gguf_interleave.restype = ctypes.c_int
        self.simd_level = lib.gguf_simd_level()  # 0 portable C, 1 AVX2, 2 VNNI dot products
        # Products of 16+ rows on the interleaved formats run on AMX int8 tiles when this is 1:
        # built for them, permitted by the OS and checked against the VNNI path (0: a build
        # without tiles, -1: the OS refused them, -2: they disagreed with the VNNI path).
        self.amx_status = lib.gguf_amx_ready()
        if self.amx_status == -2:
            log.warning("AMX int8 tiles gave other bits than the VNNI path: GGUF products stay on VNNI")
        self._matmul = lib.gguf_matmul
        self._local = threading.local()  # each thread's scratch buffer, grown on demand

    def row_bytes(self, qtype: int, cols: int) -> int:
        elems = self._lib.gguf_block_elems(qtype)
        if elems == 0:
            raise ValueError(f"ggml type {qtype} has no native kernel")
        if cols % elems:
            raise ValueError(f"a row of {cols} values is not a whole number of {elems}-value blocks")
        return cols // elems * self._lib.gguf_block_bytes(qtype)

    def interleave(self, matrix: PackedMatrix) -> PackedMatrix:
        """The matrix with every eight rows interleaved, a new copy (the same products, bit for
        bit, faster: deepinfer/bench/gguf_kernels.py); the matrix itself when its format or row count has
        no interleaved form."""
        if not self._lib.gguf_interleaved_type(matrix.qtype, matrix.rows, matrix.cols):
            return matrix
        source = np.ascontiguousarray(matrix.data)
        data = np.empty_like(source)
        qtype = self._lib.gguf_interleave(
            matrix.qtype, source.ctypes.data, matrix.rows, matrix.cols, data.ctypes.data
        )
        return PackedMatrix(qtype, matrix.rows, matrix.cols, data)

    def matmul(
        self, x: torch.Tensor, group: PackedGroup, portable: bool = False, tiles: bool = True
    ) -> torch.Tensor:
        """x [M, K] float32 -> [M, group.rows] float32. `portable` forces the plain C path;
        `tiles=False` keeps the vector path off AMX tiles (the same bits either way)."""
        x = self._input(x, group.cols)
        return self._run(x, group, portable, _PROLOGUE_NONE, tiles=tiles)

    def matmul_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        group: PackedGroup,
        portable: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(v) * weight @ W^T, v) with v = x + residual (x when residual is None): an
        RMSNorm fused into the product (v is the new residual stream). x, residual [M, K]."""
        x = self._input(x, group.cols)
        if x.stride(0) != group.cols:
            x = x.contiguous()
        if weight.dtype is not torch.float32 or not weight.is_contiguous() or weight.numel() != group.cols:
            raise ValueError(f"expected a contiguous float32 norm weight of {group.cols} values")
        if residual is None:
            return self._run(x, group, portable, _PROLOGUE_RMS_NORM, None, None, weight, eps), x
        if residual.shape != x.shape or residual.dtype is not torch.float32 or not residual.is_contiguous():
            raise ValueError(f"expected a contiguous float32 residual of shape {tuple(x.shape)}")
        summed = torch.empty_like(x)
        return self._run(x, group, portable, _PROLOGUE_RMS_NORM, residual, summed, weight, eps), summed

    def matmul_swiglu(
        self, gate_up: torch.Tensor, group: PackedGroup, portable: bool = False
    ) -> torch.Tensor:
        """(silu(gate) * up) @ W^T for gate_up [M, 2K] = [gate | up]: SwiGLU fused into the product."""
        if gate_up.dtype is not torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] != 2 * group.cols:
            raise ValueError(
                f"expected float32 [M, {2 * group.cols}], got {gate_up.dtype} {tuple(gate_up.shape)}"
            )
        gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
        return self._run(gate_up, group, portable, _PROLOGUE_SWIGLU)

    @staticmethod
    def _input(x: torch.Tensor, cols: int) -> torch.Tensor:
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != cols:
            raise ValueError(f"expected float32 [M, {cols}], got {x.dtype} {tuple(x.shape)}")
        return x if x.stride(1) == 1 else x.contiguous()

    def _run(
        self,
        x: torch.Tensor,
        group: PackedGroup,
        portable: bool,
        prologue: int,
        residual: torch.Tensor | None = None,
        summed: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        eps: float = 0.0,
        tiles: bool = True,
    ) -> torch.Tensor:
        m = x.shape[0]
        path = _PATH_PORTABLE if portable else _PATH_TILES if tiles else _PATH_VECTOR
        y = torch.empty(m, group.rows, dtype=torch.float32)
        self._matmul(
            x.data_ptr(), m, group.cols, x.stride(0), group.count, group.qtypes, group.pointers, group.row_counts,
            self._scratch(group, m), y.data_ptr(), group.rows, path, prologue,
            None if residual is None else residual.data_ptr(), None if summed is None else summed.data_ptr(),
            None if weight is None else weight.data_ptr(), eps,
        )  # fmt: skip
        return y

    def _scratch(self, group: PackedGroup, m: int) -> int:
        """Address of this thread's scratch, at least as large as the call needs (the kernel
        writes the quantized activations there; nothing is kept between calls)."""
        size = group.scratch_sizes.get(m)
        if size is None:
            size = group.scratch_sizes[m] = self._lib.gguf_scratch_bytes(
                m, group.cols, group.count, group.qtypes
            )
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._local.buffer = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
        return buffer.data_ptr()

    def dequantize_rows(self, matrix: PackedMatrix, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, cols] float32: those rows, dequantized exactly as the gguf package does."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= matrix.rows):
            raise IndexError(f"row ids must lie in [0, {matrix.rows})")
        out = torch.empty(ids.numel(), matrix.cols, dtype=torch.float32)
        self._lib.gguf_dequantize_rows(
            matrix.qtype, matrix.data.ctypes.data, matrix.cols, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out


class PackedGroup:
    """Matrices multiplied together as one [sum(rows), cols] matrix (kept alive here)."""

    __slots__ = (
        "_arrays",
        "cols",
        "count",
        "matrices",
        "pointers",
        "qtypes",
        "row_counts",
        "rows",
        "scratch_sizes",
    )

    def __init__(self, matrices: Sequence[PackedMatrix]) -> None:
        if not matrices or len({m.cols for m in matrices}) != 1:
            raise ValueError("a packed group needs one or more matrices with the same number of columns")
        for m in matrices:
            if not (m.data.flags.c_contiguous and m.data.dtype == np.uint8 and m.data.shape[0] == m.rows):
                raise ValueError("packed data must be C-contiguous uint8 [rows, bytes per row]")
        self.matrices = list(matrices)
        self.cols = matrices[0].cols
        self.rows = sum(m.rows for m in matrices)
        self.count = len(matrices)
        # ctypes arrays built once: a call passes their addresses
        self._arrays = (
            (ctypes.c_int32 * self.count)(*(m.qtype for m in matrices)),
            (ctypes.c_void_p * self.count)(*(m.data.ctypes.data for m in matrices)),
            (ctypes.c_int64 * self.count)(*(m.rows for m in matrices)),
        )
        self.qtypes, self.pointers, self.row_counts = (ctypes.addressof(a) for a in self._arrays)
        self.scratch_sizes: dict[int, int] = {}  # rows -> scratch bytes, memoized

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices)


def gguf_kernels(target_flags: tuple[str, ...] | None = None) -> GGUFKernels | None:
    """The kernels built for `target_flags` (default: kernels/isa.py's level); None when no C
    compiler is available."""
    return _gguf_kernels(isa.compiler_flags() if target_flags is None else target_flags)


@cache
def _gguf_kernels(target_flags: tuple[str, ...]) -> GGUFKernels | None:
    lib = load_kernel_library("gguf_matmul", _FLAGS, target_flags)
    return None if lib is None else GGUFKernels(lib)
