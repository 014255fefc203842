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
from collections.abc import Sequence
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


class BuildError(RuntimeError):
    """No C compiler here, or the compiler refused a source."""


def compile_library(source: Path, flags: Sequence[str] = (), key: bytes = b"") -> Path:
    """Build `source` into an OpenMP shared library (`_FLAGS`, then `flags`) under the DeepInfer
    cache, once per (source, `key`, compiler, flags), and return its path. Raises BuildError
    without a compiler or when the build fails (the compiler's last output in the message)."""
    flags = [*_FLAGS, *flags]
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise BuildError("no C compiler found")
    identity = source.read_bytes() + key + " ".join([compiler, *flags]).encode()
    digest = hashlib.sha256(identity).hexdigest()[:16]
    target = cache_dir("kernels") / f"{source.stem}-{digest}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if result.returncode != 0:
                raise BuildError(f"building {source.name} failed: {result.stderr[-2000:]}")
            os.replace(built, target)  # atomic: concurrent builders never load half a file
    return target


@cache
def _load(name: str, extra_flags: tuple[str, ...], target_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    # A source may include headers and other sources of this folder (decode_layers.c includes
    # gguf_matmul.c): all of them are in the key.
    siblings = b"".join(p.read_bytes() for p in sorted(source.parent.glob("*.[ch]")) if p != source)
    try:
        return ctypes.CDLL(str(compile_library(source, [*target_flags, *extra_flags], siblings)))
    except BuildError as error:
        log.warning("%s; using the PyTorch reference kernels", error)
        return None
