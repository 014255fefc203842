"""instructor (pinned, in its own venv: `make python-clients`) against the real server, in all five
modes it offers an OpenAI-compatible server: TOOLS and TOOLS_STRICT (a forced call), JSON
(`json_object`), MD_JSON (a fenced block, unconstrained) and JSON_SCHEMA (a pydantic schema
without `additionalProperties`, closed by the server's strict default)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = ROOT / "build" / "clients" / "instructor" / "bin" / "python"
SCRIPT = Path(__file__).with_name("instructor_modes.py")
MODES = ("TOOLS", "TOOLS_STRICT", "JSON", "MD_JSON", "JSON_SCHEMA")


@pytest.mark.skipif(
    not INSTRUCTOR_PYTHON.exists(), reason="instructor is not installed (make python-clients)"
)
def test_instructor_returns_a_valid_object_in_every_mode(server) -> None:
    run = subprocess.run(
        [str(INSTRUCTOR_PYTHON), str(SCRIPT), server.url + "/v1", API_KEY, MODEL, *MODES],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = {line["mode"]: line for line in map(json.loads, run.stdout.splitlines())}
    assert list(results) == list(MODES), run.stdout
    failed = {mode: r["error"] for mode, r in results.items() if "error" in r}
    assert not failed, failed
    for mode, result in results.items():
        city = result["object"]
        # Only the model's fields (instructor validated them): no extra key came back.
        assert set(city) == {"name", "country"} and city["name"], (mode, city)
