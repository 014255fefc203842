"""Which instruction set the C kernels are built for: detected at run time, lowered on request.

The machines this project runs on change kind (AMD Zen 4/5 with AVX-512 VNNI/BF16, Intel Xeon
with AMX, older AVX2-only hosts), so every kernel keeps a portable C path and its vector paths,
chosen at compile time by the `__AVX2__`-style macros the flags below turn on. By default a
kernel is built for the best level the CPU reports, with that level's explicit flags (and
`-mtune=native`, which schedules but never changes an operation) rather than `-march=native`: two
CPUs of one level, an AMD Zen 4 and an Intel Xeon say, then run the same code and get the same
bits. `DEEPINFER_CPU_ISA` names a lower level to run instead (e.g. `DEEPINFER_CPU_ISA=avx2` on an
AVX-512 machine runs the AVX2 machines' code), which is how the tests run every path this machine
has against the portable one, and how a user rules out a vector path when chasing a difference.

Levels, each including the ones before it (x86-64 only; elsewhere `portable` and `-march=native`):

| level        | CPU flags (/proc/cpuinfo)                 | what the kernels do with it            |
|--------------|-------------------------------------------|----------------------------------------|
| portable     | -                                         | plain C loops                          |
| avx2         | avx2 fma f16c                             | 8-wide dot products, F16C KV loads     |
| avx512       | + avx512f avx512bw avx512vl avx512dq      | 16-lane attention tiles and exp        |
| avx512_vnni  | + avx512_vnni                             | int8 dot products, paired 8-row tiles  |
| avx512_bf16  | + avx512_bf16                             | bf16 weights stay bf16, VDPBF16PS GEMM |
| amx          | + amx_tile amx_int8 amx_bf16              | int8 tiles (GGUF, 16+ rows), bf16 tiles |
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

ENV = "DEEPINFER_CPU_ISA"
NATIVE = "native"


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    cpu_flags: frozenset[str]  # every flag /proc/cpuinfo must list
    compiler_flags: tuple[str, ...]  # what gcc is told, from the x86-64 baseline up


def _levels() -> tuple[Level, ...]:
    steps = [
        ("portable", (), ()),
        ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
        (
            "avx512",
            ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        ),
        ("avx512_vnni", ("avx512_vnni",), ("-mavx512vnni",)),
        ("avx512_bf16", ("avx512_bf16",), ("-mavx512bf16",)),
        ("amx", ("amx_tile", "amx_int8", "amx_bf16"), ("-mamx-tile", "-mamx-int8", "-mamx-bf16")),
    ]
    levels, cpu, compiler = [], frozenset[str](), ("-march=x86-64",)
    for name, cpu_flags, compiler_flags in steps:
        cpu, compiler = cpu | frozenset(cpu_flags), (*compiler, *compiler_flags)
        levels.append(Level(name, cpu, compiler))
    return tuple(levels)


X86_LEVELS = _levels()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@cache
def cpu_flags() -> frozenset[str]:
    """The feature flags the kernel reports for this CPU (empty where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def machine_levels() -> tuple[Level, ...]:
    """The levels this CPU runs, lowest first; `portable` always."""
    if not is_x86():
        return (Level("portable", frozenset(), ()),)
    flags = cpu_flags()
    return tuple(level for level in X86_LEVELS if level.cpu_flags <= flags)


def best_level() -> str:
    return machine_levels()[-1].name


def selected_level() -> str:
    """`DEEPINFER_CPU_ISA` when set (checked against this CPU), else `native`."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if not wanted or wanted == NATIVE:
        return NATIVE
    available = {level.name for level in machine_levels()}
    if wanted not in available:
        known = ", ".join(level.name for level in X86_LEVELS) if is_x86() else "portable"
        raise ValueError(
            f"{ENV}={wanted!r}: this CPU runs {', '.join(sorted(available))} (levels: {known}, or native)"
        )
    return wanted


def compiler_flags(level: str | None = None) -> tuple[str, ...]:
    """The target flags for `level` (default: the selected one)."""
    level = selected_level() if level is None else level
    if level == NATIVE:
        if not is_x86():
            return ("-march=native",)
        return (*machine_levels()[-1].compiler_flags, "-mtune=native")
    for candidate in machine_levels():
        if candidate.name == level:
            return candidate.compiler_flags
    raise ValueError(f"{ENV}: this CPU cannot run level {level!r}")


def runs_bfloat16() -> bool:
    """Whether the selected level has native bf16 arithmetic (AVX512-BF16, AMX): `dtype=auto`
    keeps a bf16 checkpoint in bf16 only then. torch's GEMMs (oneDNN) use the CPU's own
    instructions whatever this says, but a level forced below avx512_bf16 stands for a CPU
    without them, where oneDNN emulates bf16 and fp32 is the faster choice."""
    level = selected_level()
    level = best_level() if level == NATIVE else level
    names = [candidate.name for candidate in X86_LEVELS]
    return level in names and names.index(level) >= names.index("avx512_bf16")


def describe() -> str:
    """What the kernels are built for, for logs and /v1/engine_info: e.g. `avx512_bf16 (native)`."""
    level = selected_level()
    return f"{best_level()} (native)" if level == NATIVE else level
