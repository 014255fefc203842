"""The package's import rules, read from the source (every import statement, at any depth,
including those only type checkers follow): no circles between files, and no arrow from a
lower floor to a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deepinfer"

# The model families: each folder under deepinfer/model/ imports only shared code.
FAMILIES = ("llama", "deepseek_v3", "deepseek_v4")
MODEL_SHARED = (
    "deepinfer.model.base",
    "deepinfer.model.config",
    "deepinfer.model.layers",
    "deepinfer.model.loader",
    "deepinfer.model.parallel",
    "deepinfer.model.registry",
)

# What serves requests or drives processes: nothing that computes a step may import it.
EDGE = (
    "deepinfer.server",
    "deepinfer.router",
    "deepinfer.frontend",
    "deepinfer.bench",
    "deepinfer.encoder",
    "deepinfer.entrypoints",
    "deepinfer.cli",
)
ENGINE = ("deepinfer.engine", "deepinfer.speculative")
COMPUTE = (
    "deepinfer.runner",
    "deepinfer.model",
    "deepinfer.attention",
    "deepinfer.kernels",
    "deepinfer.distributed",
)

# importer prefix -> prefixes it may never import
NEVER: dict[str, tuple[str, ...]] = {
    # The family records: read by the recipe, the models, the encoder and the server alike.
    "deepinfer.families": (
        *EDGE,
        *ENGINE,
        *COMPUTE,
        "deepinfer.recipe",
        "deepinfer.structured",
        "deepinfer.config",
    ),
    # Torch-free ground floors: the recipe (a product of its own), file formats, wire transport,
    # configuration, stores.
    "deepinfer.recipe": (*EDGE, *ENGINE, *COMPUTE, "deepinfer.structured"),
    "deepinfer.formats": (*EDGE, *ENGINE, *COMPUTE, "deepinfer.recipe"),
    "deepinfer.transport": (*EDGE, *ENGINE, *COMPUTE),
    "deepinfer.config": (*EDGE, *ENGINE, *COMPUTE),
    "deepinfer.store": (*EDGE, *ENGINE, *COMPUTE),
    "deepinfer.response_store": (*EDGE, *ENGINE, *COMPUTE),
    "deepinfer.security": (*EDGE, *ENGINE, *COMPUTE, "deepinfer.recipe"),
    # The compute floors never reach up to the engine, the edge or the API layer of the recipe.
    "deepinfer.kernels": (
        *EDGE,
        *ENGINE,
        "deepinfer.runner",
        "deepinfer.model",
        "deepinfer.attention",
        "deepinfer.recipe",
    ),
    "deepinfer.attention": (*EDGE, *ENGINE, "deepinfer.runner", "deepinfer.model", "deepinfer.recipe"),
    "deepinfer.model": (*EDGE, *ENGINE, "deepinfer.runner", "deepinfer.recipe.api"),
    "deepinfer.runner": (*EDGE, *ENGINE, "deepinfer.recipe.api"),
    "deepinfer.engine": EDGE,
    "deepinfer.speculative": (*EDGE, "deepinfer.engine"),
    "deepinfer.frontend": ("deepinfer.server", "deepinfer.router", "deepinfer.bench", "deepinfer.cli"),
    "deepinfer.server": ("deepinfer.router", "deepinfer.bench", "deepinfer.cli"),
    # The router loads no model: of the engine's floors it reads only torch-free helpers (prefix
    # hashing, a checkpoint's tokenizer files).
    "deepinfer.router": (
        "deepinfer.runner",
        "deepinfer.attention",
        "deepinfer.kernels",
        "deepinfer.speculative",
        "deepinfer.bench",
        "deepinfer.cli",
    ),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, files: set[str]) -> set[str]:
    """The deepinfer files `path` (module `name`) imports: `from package import module` names the
    module's file, not the package's __init__."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
    return {m for m in out if m in files and m != name}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


GRAPH = _graph()


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read() -> None:
    assert len(GRAPH) > 300
    assert "deepinfer.engine.scheduler" in GRAPH["deepinfer.engine.core"]


def test_no_file_imports_itself_through_others() -> None:
    # Package __init__ files that only hand names on are skipped as links: importing a package
    # runs its __init__, not its siblings.
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for start in sorted(GRAPH):
        if start not in state:
            visit(start, [start])
    assert circles == []


@pytest.mark.parametrize("importer", sorted(NEVER))
def test_no_arrow_runs_up(importer: str) -> None:
    wrong = sorted(
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        if _within(src, (importer,))
        for dst in targets
        if _within(dst, NEVER[importer])
    )
    assert wrong == []


def test_families_import_only_shared_model_code() -> None:
    families = tuple(f"deepinfer.model.{family}" for family in FAMILIES)
    wrong = []
    for src, targets in GRAPH.items():
        for dst in targets:
            if not _within(dst, families):
                continue
            own = next((f for f in families if _within(src, (f,))), None)
            if own is not None and not _within(dst, (own,)):
                wrong.append(f"{src} -> {dst}")  # one family reaching into another
            elif own is None and _within(
                src, ("deepinfer.model", "deepinfer.attention", "deepinfer.kernels")
            ):
                wrong.append(f"{src} -> {dst}")  # shared model code reaching into a family
    assert wrong == []
