"""Reporting helpers shared by every benchmark: provenance, JSON results and markdown tables."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from deepinfer.engine.parallel.cores import cgroup_cpu_limit, usable_cpus

# Distributions whose versions explain a number; absent ones are reported as None.
VERSIONED_PACKAGES: tuple[str, ...] = (
    "deepinfer",
    "torch",
    "numpy",
    "transformers",
    "httpx",
    "llama-cpp-python",
)


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a shell would take it back, so a result says how to reproduce it."""
    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith(("__main__.py", "cli.py")):
        args = [sys.executable, "-m", "deepinfer.bench", *args[1:]]
    return shlex.join(args)


def package_versions(names: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if "deepinfer" in versions and versions["deepinfer"] is None:
        # A source checkout run without `pip install -e .` still knows its own version.
        from deepinfer import __version__

        versions["deepinfer"] = __version__
    return versions


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1024 * 1024), 2)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; usable cores are the ones this process may keep busy
    (its affinity, its cgroup's CPU quota)."""
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cpus(),
        "cgroup_cpu_limit": cgroup_cpu_limit(),
        "memory_gib": _memory_gib(),
        # Other work on the machine skews every number; say how busy it was when measuring.
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The header every result file carries: command, date, machine and versions."""
    return {
        "command": command_line(argv),
        "date": utc_now_iso(),
        "machine": machine_info(),
        "versions": package_versions(),
    }


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=False, allow_nan=False) + "\n")
    return target


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"result file not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"result file {path} is not valid JSON: {exc}") from exc


def format_number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 2) -> str:
    """A GitHub markdown table; floats get ``digits`` decimals and None becomes a dash."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    for row in rows:
        cells = (format_number(cell, digits).replace("|", "\\|").replace("\n", " ") for cell in row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_marked_section(path: str | os.PathLike[str], name: str, body: str) -> Path:
    """Put ``body`` between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in a markdown file.

    The markers are appended when absent, so a hand-written document around them survives.
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    target = Path(path)
    text = target.read_text() if target.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start != -1 else -1
    if start != -1 and stop != -1:
        text = text[:start] + block + text[stop + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target
