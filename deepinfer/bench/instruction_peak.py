"""This core's multiply instructions per second: the ceiling a kernel made of them can reach.

    .venv/bin/python -m deepinfer.bench.instruction_peak [--threads 1 2] [--seconds 0.5]

`bench peak` measures what torch's GEMMs reach; this measures the instructions themselves, twelve
independent chains of one instruction at a time (`instruction_peak.c`), so a kernel's GOP/s can be
set against the most its instructions allow: the GGUF products against VPDPBUSD (AVX-512 VNNI) or
VPMADDUBSW (AVX2), the fp32 ones against VFMADD231PS. Only the kinds this CPU has are run. The
figure is the best of `--repeats` runs of about `--seconds` each.
"""

from __future__ import annotations

import argparse
import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from deepinfer.kernels import isa
from deepinfer.kernels.build import compile_library


@dataclass(frozen=True, slots=True)
class Kind:
    """One instruction the C file times: its index there, the CPU flag it needs, and the
    multiply-add operations (2 per product) one instruction does."""

    index: int
    name: str
    cpu_flag: str
    ops: int


KINDS = (
    Kind(0, "VPDPBUSD zmm (int8, AVX-512 VNNI)", "avx512_vnni", 2 * 64),
    Kind(1, "VPMADDUBSW ymm (int8 pairs, AVX2)", "avx2", 2 * 32),
    Kind(2, "VFMADD231PS zmm (fp32, AVX-512F)", "avx512f", 2 * 16),
    Kind(3, "VFMADD231PS ymm (fp32, FMA)", "fma", 2 * 8),
)


def available_kinds() -> tuple[Kind, ...]:
    """The kinds this CPU runs (none off x86-64: the file is x86 assembly)."""
    if not isa.is_x86():
        return ()
    flags = isa.cpu_flags()
    return tuple(kind for kind in KINDS if kind.cpu_flag in flags)


@cache
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(compile_library(Path(__file__).with_name("instruction_peak.c"))))
    library.instruction_rate.restype = ctypes.c_double
    library.instruction_rate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return library


def instruction_rate(kind: Kind, threads: int, iterations: int) -> float:
    """Instructions per second of `kind` over `threads` threads together, each running
    12 * `iterations` of them. Raises for a kind this CPU lacks (it would die of SIGILL)."""
    if kind not in available_kinds():
        raise ValueError(f"this CPU has no {kind.cpu_flag}: cannot time {kind.name}")
    rate = _library().instruction_rate(kind.index, threads, iterations)
    if rate <= 0:
        raise RuntimeError(f"instruction_peak.c does not know kind {kind.index}")
    return rate


def best_rate(kind: Kind, threads: int, seconds: float, repeats: int) -> float:
    """The best of `repeats` timings of about `seconds` each (the first call sizes them)."""
    per_thread = instruction_rate(kind, threads, 1_000_000) / threads  # instructions per second
    iterations = max(1, int(seconds * per_thread / 12))
    return max(instruction_rate(kind, threads, iterations) for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    kinds = available_kinds()
    if not kinds:
        raise SystemExit("no instruction this benchmark times runs on this CPU")
    print(f"kernels' level: {isa.describe()}")
    print("\n| instruction | threads | G instructions/s per thread | GOP/s, all threads |")
    print("| --- | --- | --- | --- |")
    for kind in kinds:
        for threads in args.threads:
            rate = best_rate(kind, threads, args.seconds, args.repeats)
            print(f"| {kind.name} | {threads} | {rate / threads / 1e9:.2f} | {rate * kind.ops / 1e9:.1f} |")


if __name__ == "__main__":
    main()
