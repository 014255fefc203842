"""README.md's route table names every route `deepinfer serve` answers, and no route it does not.

The app is the one `deepinfer serve` runs (`build_app`); its routes are fixed when it is built and
do not depend on the server state, which `build_app` only stores, so a stand-in state is passed
and no model loads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI

from deepinfer.server.app import build_app
from deepinfer.server.state import ServerState

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_HEADER = "| Route |"
# FastAPI's own pages, should a later app turn them on: not routes of the API.
FRAMEWORK_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})
IMPLICIT_METHODS = frozenset({"HEAD", "OPTIONS"})  # what a framework adds beside GET, not a route
ROUTE_IN_CELL = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")
PATH_CONVERTER = re.compile(r"\{(\w+):\w+\}")  # `{model:path}` is written `{model}` in the README


def _normalized(path: str) -> str:
    return PATH_CONVERTER.sub(r"{\1}", path)


def _flat_routes(app: FastAPI) -> Iterable[Any]:
    """Every route of the app, those of included routers too."""
    try:
        # Newer FastAPI keeps an included router as one entry of `app.routes`.
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return app.routes  # older FastAPI copies included routes into `app.routes`
    return iter_route_contexts(app.routes)


def served_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the app `deepinfer serve` builds."""
    app = build_app(cast(ServerState, object()))
    routes = set()
    for route in _flat_routes(app):
        path = getattr(route, "path", None)
        if path is None or path in FRAMEWORK_PATHS:
            continue
        methods = set(getattr(route, "methods", None) or ()) - IMPLICIT_METHODS
        routes |= {(method, _normalized(path)) for method in methods}
    return routes


def documented_routes(text: str) -> set[tuple[str, str]]:
    """(method, path) named in the first cell of each row of README's route table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_HEADER))
    routes = set()
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first_cell = line.split("|")[1]
        routes |= {(method, _normalized(path)) for method, path in ROUTE_IN_CELL.findall(first_cell)}
    return routes


def test_every_served_route_is_in_the_readme() -> None:
    served = served_routes()
    assert ("POST", "/v1/chat/completions") in served  # the app was read, not an empty list
    missing = served - documented_routes(README.read_text(encoding="utf-8"))
    assert not missing, f"routes the app serves that README.md's route table lacks: {sorted(missing)}"


def test_the_readme_names_no_route_the_app_lacks() -> None:
    stale = documented_routes(README.read_text(encoding="utf-8")) - served_routes()
    assert not stale, f"routes README.md's route table names that the app does not serve: {sorted(stale)}"


def test_a_missing_route_is_caught() -> None:
    table = "| Route | What it does | Auth |\n|---|---|---|\n| `POST /v1/completions` | x | y |\n"
    assert ("POST", "/v1/chat/completions") not in documented_routes(table)
    assert documented_routes(table) == {("POST", "/v1/completions")}
