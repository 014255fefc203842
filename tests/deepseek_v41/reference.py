"""Where DeepSeek's reference sources are: ../shared/reference from the repository root, or the
shared folder of the workplace for a checkout elsewhere (a clean clone under /tmp)."""

from __future__ import annotations

from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
if not REFERENCE.exists():
    REFERENCE = Path("/work/shared/reference")
ENGINE_SDIST = "deepinfer-0.1.0.tar.gz"
TILE_KERNELS_WHEEL = "tile_kernels-2.1.0-py3-none-any.whl"


def reference_file(name: str) -> Path:
    """A reference package; missing is a failure (CI has ../shared too), never a skip."""
    path = REFERENCE / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: the reference sources are expected in ../shared/reference")
    return path
