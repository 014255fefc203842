"""A tiny DeepSeek-V3 checkpoint (as tests/deepseek builds them) and helpers for the ranks'
processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deepseek.conftest import VARIANTS
from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory) -> TinyCheckpoint:
    overrides, fp8, seed = VARIANTS["v3"]
    return build_checkpoint(tmp_path_factory.mktemp("v3-parallel"), overrides, fp8=fp8, seed=seed)


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found
