"""Linear layers and embeddings that compute on GGUF-packed weights (quantization="gguf").

The weights stay in the file's blocks (memory-mapped where no reordering was needed); the C kernel
quantizes each activation row per block and multiplies with exact integer block dot products, as
llama.cpp does (numerics in deepinfer/kernels/gguf_matmul.c). A fused projection (q/k/v,
gate/up) is a group of packed matrices computed in one call, each in its own format, so mixed
files (a Q6_K v_proj beside Q4_K q/k) need no conversion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepinfer.kernels.gguf_blocks import GGUFKernels, PackedGroup, PackedMatrix, gguf_kernels


def native_kernels() -> GGUFKernels:
    kernels = gguf_kernels()
    if kernels is None:
        raise RuntimeError("quantization='gguf' needs a C compiler to build its kernels (none found)")
    return kernels


class GGUFLinear(torch.nn.Module):
    """y = x W^T + b, W the row concatenation of packed matrices of one width."""

    def __init__(self, matrices: Sequence[PackedMatrix], bias: bool = False) -> None:
        super().__init__()
        self.group = PackedGroup(matrices)
        self.in_features, self.out_features = self.group.cols, self.group.rows
        self._kernels = native_kernels()
        self.bias = torch.nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._kernels.matmul(x.reshape(-1, self.in_features).float(), self.group)  # [T, out]
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

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


def packed_linear(
    packed: Mapping[str, PackedMatrix], names: Sequence[str], bias: bool, used: set[str]
) -> GGUFLinear | None:
    """A GGUFLinear over `names` (in order) when all are packed; their names are added to `used`."""
    if not all(name in packed for name in names):
        return None
    used.update(names)
    return GGUFLinear([packed[name] for name in names], bias=bias)
