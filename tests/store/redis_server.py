"""A real redis-server on a free loopback port, in its own directory, for the store tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from deepinfer.distributed.topology import free_port

INSTALL_HINT = (
    "redis-server is not installed; `make test` installs it (apt-get install -y redis-server), "
    "or set it up yourself"
)


class RedisServer:
    """Append-only with fsync on every write, so a SIGKILLed server restarts with its data."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.workdir),
                "--save", "",
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--logfile", str(log),
                "--daemonize", "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited early: {log.read_text(errors='replace')[-2000:]}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer within {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """Crash it (SIGKILL), as a machine failure would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of this test's own, stopped after it (a missing binary fails the test)."""
    try:
        server = RedisServer(tmp_path / "redis")
    except RuntimeError as exc:
        pytest.fail(str(exc))
    server.start()
    yield server
    server.stop()
