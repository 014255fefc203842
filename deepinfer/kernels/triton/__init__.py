"""Triton kernels: the GPU path, proven on the CPU under Triton's interpreter.

Every kernel here has a torch reference it is tested against (tests/triton, run with
TRITON_INTERPRET=1 on CPU tensors; deepinfer/bench/device_check.sh runs the same tests on real CUDA).
`triton.jit` decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET
must be set before any module of this package is imported.
"""

from __future__ import annotations

import importlib.util
import os


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (on CPU tensors) instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable_on(device_type: str) -> bool:
    """Whether the kernels can run on tensors of `device_type` in this process: compiled on CUDA,
    interpreted on the CPU (only when TRITON_INTERPRET was set before the import)."""
    if not triton_installed():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreting())


def next_power_of_2(n: int) -> int:
    """Block sizes are powers of two; dots need at least 16 along every axis."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())
