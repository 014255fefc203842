"""This machine's GEMM peak, the denominator of MFU: best-of square matmuls, fp32 and int8."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

DEFAULT_GEMM_SIZES: tuple[int, ...] = (256, 512, 1024, 2048)


def best_time(action: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` runs after one warm-up (allocation, thread start-up)."""
    action()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm_flops(sizes: Sequence[int], threads: int, repeats: int = 5) -> dict[int, float]:
    """Best-of fp32 square matmul FLOP/s per size (2·n³ FLOPs each)."""
    import torch

    torch.set_num_threads(threads)
    results: dict[int, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        results[n] = 2.0 * n**3 / best_time(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out), repeats)
    return results


def measure_int8_gemm_ops(sizes: Sequence[int], threads: int, repeats: int = 5) -> float:
    """Best int8 x int8 -> int32 square matmul rate (2·n³ ops each): the peak for int8 weights."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for n in sizes:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        best = max(best, 2.0 * n**3 / best_time(lambda a=a, b=b: torch._int_mm(a, b), repeats))
    return best
