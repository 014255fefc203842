"""Linear layers and embeddings that compute on GGUF-packed weights (quantization="gguf").

The weights stay in the file's blocks (interleaved eight rows at a time where the row count
allows, KernelLayouts: a copy at load, the same size; memory-mapped otherwise); the C kernel
quantizes each activation row per block and multiplies with exact integer block dot products, as
llama.cpp does (numerics in deepinfer/kernels/gguf_matmul.c). A fused projection (q/k/v,
gate/up) is a group of packed matrices computed in one call, each in its own format, so mixed
files (a Q6_K v_proj beside Q4_K q/k) need no conversion.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from deepinfer.kernels.gguf_blocks import GGUFKernels, PackedGroup, PackedMatrix, gguf_kernels
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.parallel_linear import Segment


def native_kernels() -> GGUFKernels:
    kernels = gguf_kernels()
    if kernels is None:
        raise RuntimeError("quantization='gguf' needs a C compiler to build its kernels (none found)")
    return kernels


class KernelLayouts(Mapping[str, PackedMatrix]):
    """A loader's packed matrices in the layout the kernels compute on fastest: each one
    interleaved (GGUFKernels.interleave) when first read, once, so that a tied embedding and LM
    head share a copy; the loader's own mapping keeps the file's blocks."""

    def __init__(self, packed: Mapping[str, PackedMatrix]) -> None:
        self._packed = packed
        self._interleaved: dict[str, PackedMatrix] = {}

    def __getitem__(self, name: str) -> PackedMatrix:
        matrix = self._interleaved.get(name)
        if matrix is None:
            matrix = self._interleaved[name] = native_kernels().interleave(self._packed[name])
        return matrix

    def __contains__(self, name: object) -> bool:
        return name in self._packed

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


class GGUFLinear(torch.nn.Module):
    """y = x W^T + b, W the row concatenation of packed matrices of one width."""

    def __init__(self, matrices: Sequence[PackedMatrix], bias: bool = False) -> None:
        super().__init__()
        self.group = PackedGroup(matrices)
        self.in_features, self.out_features = self.group.cols, self.group.rows
        self._kernels = native_kernels()
        self.bias = torch.nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    @property
    def segments(self) -> list[PackedMatrix]:
        """The packed matrices, in row order (q/k/v or gate/up of a fused projection)."""
        return self.group.matrices

    @property
    def splits(self) -> dict[str, tuple[int, list[Segment]]]:
        """How the loader fills this layer (loader/shards.py): the packed weights are in place and
        never split, the bias is whole, one segment per packed matrix."""
        if self.bias is None:
            return {}
        return {"bias": (0, [Segment.whole(m.rows) for m in self.segments])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the model's case: [T, in] -> [T, out]
            y = self._kernels.matmul(x, self.group)
        else:
            y = self._kernels.matmul(x.reshape(-1, self.in_features).float(), self.group)
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def forward_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(v)), v) with v = x + residual (x when residual is None), the norm computed
        in the kernel's activation pass instead of a call of its own. x: [T, in] float32."""
        y, summed = self._kernels.matmul_rms_norm(x, residual, norm.weight, norm.eps, self.group)
        if self.bias is not None:
            y.add_(self.bias)
        return y, summed

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [T, 2 * in] = [gate | up], fused likewise."""
        y = self._kernels.matmul_swiglu(gate_up, self.group)
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.group.nbytes / 2**20:.1f} MiB packed"


class GGUFEmbedding(torch.nn.Module):
    """Token lookup that dequantizes only the rows asked for (bit-equal to full dequantization)."""

    def __init__(self, matrix: PackedMatrix, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.matrix, self.dtype = matrix, dtype
        self.num_embeddings, self.embedding_dim = matrix.rows, matrix.cols
        self._kernels = native_kernels()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._kernels.dequantize_rows(self.matrix, ids.reshape(-1))  # [T, dim]
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)


def norm_then_project(
    norm: RMSNorm, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(v)), v) with v = x + residual, or x for the first layer (residual None):
    one fused kernel call for a packed linear on 2-D fp32 rows, the separate steps otherwise."""
    if isinstance(linear, GGUFLinear) and x.dim() == 2 and x.dtype is torch.float32:
        return linear.forward_rms_norm(x, residual, norm)
    if residual is None:
        return linear(norm(x)), x
    h, residual = norm.add_forward(x, residual)
    return linear(h), residual


def packed_linear(
    packed: Mapping[str, PackedMatrix], names: Sequence[str], bias: bool, used: set[str]
) -> GGUFLinear | None:
    """A GGUFLinear over `names` (in order) when all are packed; their names are added to `used`."""
    if not all(name in packed for name in names):
        return None
    used.update(names)
    return GGUFLinear([packed[name] for name in names], bias=bias)
