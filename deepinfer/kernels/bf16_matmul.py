"""ctypes binding of bf16_matmul.c: y = bf16(x W^T + b) for bf16 rows and weights on the CPU.

`pack` lays a weight out in the kernel's panels once; `bf16_kernels()` is None without a C
compiler; `fits` says which weights the C path takes.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library

PANEL = 16  # outputs per panel (bf16_matmul.c)

log = logging.getLogger(__name__)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W bf16 [N, K] -> panels [ceil(N/16), ceil(K/2), 16, 2] with packed[p, q, c, e] = W[16p + c, 2q + e]
    (zeros past N and K): a new tensor, W untouched."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, k % 2, 0, -n % PANEL))  # [N16, K2 * 2]
    return padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


class Bf16Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._linear = lib.bf16_linear
        self._linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._linear.restype = None
        lib.bf16_amx_ready.restype = ctypes.c_int
        # Products whose K is a multiple of 32 run on AMX bf16 tiles when this is 1 (bits of the
        # tiles' own sums, see bf16_matmul.c): built for them, permitted by the OS and wired right
        # (0: a build without tiles, -1: the OS refused them, -2: the self-check failed).
        self.amx_status = lib.bf16_amx_ready()
        if self.amx_status == -2:
            log.warning("AMX bf16 tiles failed their self-check: bf16 products stay on VDPBF16PS")

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x bf16 [..., K] (rows may be strided, values contiguous), `packed` = pack(W) of a W
        [n, K], bias fp32 [n] or None -> a new bf16 [..., n]. Reads its inputs only."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        k = rows.shape[1]
        if packed.shape[0] * PANEL < n or packed.shape[1] != (k + 1) // 2:
            raise ValueError(f"packed weight {tuple(packed.shape)} is not one of [{n}, {k}]")
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        self._linear(
            rows.data_ptr(), rows.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), n, rows.shape[0], n, k,
        )  # fmt: skip
        return out.view(*x.shape[:-1], n)


def fits(weight: torch.Tensor) -> bool:
    """Whether the C path takes this weight: bf16, on the CPU, contiguous, 2-D."""
    return weight.dtype is torch.bfloat16 and weight.is_cpu and weight.dim() == 2 and weight.is_contiguous()


def bf16_kernels(target_flags: tuple[str, ...] | None = None) -> Bf16Kernels | None:
    """The kernels built for `target_flags` (default: kernels/isa.py's level); None without a C compiler."""
    return _bf16_kernels(isa.compiler_flags() if target_flags is None else target_flags)


@cache
def _bf16_kernels(target_flags: tuple[str, ...]) -> Bf16Kernels | None:
    lib = load_kernel_library("bf16_matmul", ("-ffp-contract=off",), target_flags)
    return None if lib is None else Bf16Kernels(lib)
