"""Replicas and a router as child processes for the routing and disaggregation benchmarks:
started side by side (each loads the model), ready when they answer, stopped together.

Children never outlive the benchmark: each runs in its own process group (stopped with its
engine process), gets SIGKILL from the kernel when the benchmark dies without cleaning up
(PR_SET_PDEATHSIG: a SIGKILLed benchmark, or `timeout -s KILL`), and a SIGTERM or SIGHUP to the
benchmark (`timeout`'s default, a closed terminal) unwinds it like Ctrl-C, stopping them all."""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from deepinfer.bench.serve import BenchError
from deepinfer.distributed.topology import free_port
from deepinfer.security import read_cluster_key
from deepinfer.security.signing import PEER_HEADER, peer_token

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0


@functools.cache
def cluster_key_file() -> str:
    """The benchmark cluster's shared secret (PD handoffs need one), removed at exit."""
    directory = tempfile.mkdtemp(prefix="deepinfer-bench-key-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = os.path.join(directory, "cluster.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_hex(32))
    return path


def peer_get(url: str, path: str, timeout: float) -> httpx.Response:
    """A GET of a peer-only route (/v1/engine_info) as the router makes it."""
    token = peer_token(read_cluster_key(cluster_key_file()), "GET", path)
    return httpx.get(url + path, headers={PEER_HEADER: token}, timeout=timeout)


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
        "--cluster-key-file",
        cluster_key_file(),
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
        "--cluster-key-file",
        cluster_key_file(),
        "--log-level",
        "warning",
        *args,
    ]
    return Child(name, command, f"http://127.0.0.1:{port}", "/health", _log_path(name))


def _log_path(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"deepinfer-bench-{name}-")) / "log.txt"


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGKILL when the benchmark's main thread ends."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind the benchmark (its finally blocks stop the children) instead of
    ending the process on the spot; the previous handlers come back afterwards."""
    previous = {sig: signal.signal(sig, _raise_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def running(children: Sequence[Child], startup_timeout_s: float = 600.0) -> Iterator[list[Child]]:
    """Start every child at once, wait until all answer 200 on their ready path, stop them all
    (SIGTERM to each process group, then SIGKILL) when the block ends, however it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with _signals_unwind():
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
                        preexec_fn=_die_with_parent,
                    )
            _wait_ready(children, startup_timeout_s)
            yield list(children)
        finally:
            _stop(children)


def _wait_ready(children: Sequence[Child], startup_timeout_s: float) -> None:
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
                if peer_get(child.url, child.ready_path, 5.0).status_code == 200:
                    waiting.remove(child)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise BenchError(f"{waiting[0].name} was not ready in time:\n{_tail(waiting[0].log)}")
        time.sleep(0.5)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _stop(children: Sequence[Child]) -> None:
    """SIGTERM to every child's process group at once, SIGKILL to those still there after
    STOP_TIMEOUT_S; a second Ctrl-C while waiting goes straight to SIGKILL."""
    started = [c.process for c in children if c.process is not None]
    for process in started:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    try:
        for process in started:
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for process in started:
            _signal_group(process, signal.SIGKILL)  # the group: the engine process too
            process.wait()


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
