"""Compile the C kernels once per machine and load them with ctypes.

Plain C with no torch headers compiles in about a second, so it is built on first use and cached
under the DeepInfer cache directory, keyed by the source and the compiler flags. The target is
`kernels/isa.py`'s: the best instruction-set level this CPU reports by default (the binary never
leaves the machine that built it), or the level `DEEPINFER_CPU_ISA` names (a caller may also name
a level's flags, as the tests do to run every path this CPU has). If no compiler is available the caller
falls back to the PyTorch reference path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from deepinfer.kernels import isa
from deepinfer.utils import cache_dir

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]


def load_kernel_library(
    name: str, extra_flags: tuple[str, ...] = (), target_flags: tuple[str, ...] | None = None
) -> ctypes.CDLL | None:
    """Build (if needed) and load `<name>.c` from this package; None when it cannot be built.

    `target_flags` picks the instruction set (default: `isa.compiler_flags()`, read when called);
    `extra_flags` are the library's own (e.g. -ffp-contract=off)."""
    return _load(name, extra_flags, isa.compiler_flags() if target_flags is None else target_flags)


@cache
def _load(name: str, extra_flags: tuple[str, ...], target_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found; using the PyTorch reference kernels")
        return None
    flags = [*_FLAGS, *target_flags, *extra_flags]
    # A source may include headers and other sources of this folder (decode_layers.c includes
    # gguf_matmul.c): all of them are in the key.
    siblings = b"".join(p.read_bytes() for p in sorted(source.parent.glob("*.[ch]")) if p != source)
    digest = hashlib.sha256(
        source.read_bytes() + siblings + " ".join([compiler, *flags]).encode()
    ).hexdigest()[:16]
    target = cache_dir("kernels") / f"{name}-{digest}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if result.returncode != 0:
                log.warning(
                    "building %s failed, using the PyTorch reference: %s", name, result.stderr[-2000:]
                )
                return None
            os.replace(built, target)  # atomic: concurrent builders never load half a file
    return ctypes.CDLL(str(target))
