"""Start an HTTP inference server as a child process, wait until it answers, and stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from deepinfer.bench.serve import BenchError


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it lingers."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass


@contextmanager
def running_server(
    command: Sequence[str],
    base_url: str,
    startup_timeout_s: float,
    ready_path: str = "/v1/models",
    env: dict[str, str] | None = None,
) -> Iterator[Path]:
    """Run ``command`` until the block ends; yields the path of its combined log.

    Ready means ``GET base_url + ready_path`` answered 200. A child that exits or stays
    silent past the timeout raises BenchError with the end of its log.
    """
    log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-bench-"))
    log_path = log_dir / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group, so stopping it stops its children
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise BenchError(
                    f"{command[0]} exited with code {process.returncode} before it was ready:\n"
                    + _log_tail(log_path)
                )
            try:
                if httpx.get(base_url.rstrip("/") + ready_path, timeout=5.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{command[0]} was not ready after {startup_timeout_s:.0f} s:\n" + _log_tail(log_path)
                )
            time.sleep(0.5)
        yield log_path
    finally:
        _stop(process)
