"""Replicas and a router as child processes for the routing and disaggregation benchmarks:
started side by side (each loads the model), ready when they answer, stopped together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from deepinfer.bench.serve import BenchError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(slots=True)
class Child:
    name: str
    command: list[str]
    url: str
    ready_path: str
    log: Path
    process: subprocess.Popen[bytes] | None = None


def replica(name: str, *args: str, threads: int = 1, kv_cache_memory: str = "384MiB") -> Child:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "serve",
        "--port",
        str(port),
        "--num-threads",
        str(threads),
        "--kv-cache-memory",
        kv_cache_memory,
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--log-level",
        "warning",
        *args,
    ]
    return Child(name, command, f"http://127.0.0.1:{port}", "/v1/engine_info", _log_path(name))


def router(name: str, *args: str) -> Child:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "router",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    return Child(name, command, f"http://127.0.0.1:{port}", "/health", _log_path(name))


def _log_path(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"deepinfer-bench-{name}-")) / "log.txt"


@contextmanager
def running(children: Sequence[Child], startup_timeout_s: float = 600.0) -> Iterator[list[Child]]:
    """Start every child at once, wait until all answer 200 on their ready path, stop them all
    (SIGTERM to each process group, then SIGKILL) when the block ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        for child in children:
            with child.log.open("wb") as log:
                child.process = subprocess.Popen(
                    child.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        deadline = time.monotonic() + startup_timeout_s
        waiting = list(children)
        while waiting:
            for child in list(waiting):
                assert child.process is not None
                if child.process.poll() is not None:
                    raise BenchError(
                        f"{child.name} exited with code {child.process.returncode}:\n{_tail(child.log)}"
                    )
                try:
                    if httpx.get(child.url + child.ready_path, timeout=5.0).status_code == 200:
                        waiting.remove(child)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise BenchError(f"{waiting[0].name} was not ready in time:\n{_tail(waiting[0].log)}")
            time.sleep(0.5)
        yield list(children)
    finally:
        for child in children:
            _stop(child)


def _stop(child: Child) -> None:
    process = child.process
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def reset_caches(replicas: Sequence[Child]) -> None:
    """Forget every cached prefix (between runs of a benchmark, for a cold start each)."""
    for child in replicas:
        reply = httpx.post(child.url + "/reset_prefix_cache", timeout=60)
        if reply.status_code != 200:
            raise BenchError(f"{child.name} did not reset its prefix cache: {reply.text}")
