"""The repository's bench/ scripts, found from the package when it runs from a checkout."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def repository_root() -> Path | None:
    """The checkout this package runs from, when it has the bench/ scripts."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "bench" / "__init__.py").is_file() else None


def repo_module(name: str) -> ModuleType:
    """Import bench/<name>.py of the checkout (ValueError outside one)."""
    root = repository_root()
    if root is None:
        raise ValueError(
            f"`{name}` is a script of the DeepInfer repository (bench/{name}.py); run it from a checkout"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"bench.{name}")
