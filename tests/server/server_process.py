"""A real `deepinfer serve` in a subprocess: free port picked by the server, URL read from its
startup line, log kept for failure messages, SIGTERM to stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

SMALL_KV = "268435456"  # 256 MiB: a few hundred blocks, plenty for short test requests
_ANNOUNCE = re.compile(r"DeepInfer is serving .* at (http://\S+) .*engine pid (\d+)")


class AnnouncedProcess:
    """A `deepinfer` subcommand in a subprocess of its own session, ready once a line of its
    output matches `announce`; its log kept for failure messages, SIGTERM to stop."""

    def __init__(self, command: list[str], announce: re.Pattern[str], startup_timeout_s: float) -> None:
        self.name = command[0]  # the subcommand, for messages
        self.command = [sys.executable, "-m", "deepinfer.cli", *command]
        self.announce = announce
        self.startup_timeout_s = startup_timeout_s
        self.lines: list[str] = []
        self.url = ""
        self._announced = threading.Event()
        self.process: subprocess.Popen[str] | None = None

    def announced(self, match: re.Match[str]) -> None:
        """Read what the announcing line says (the URL is its first group)."""
        self.url = match.group(1)

    def start(self) -> AnnouncedProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
            start_new_session=True,
        )
        threading.Thread(target=self._read_output, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._announced.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"`{self.name}` did not start:\n" + self.log_tail())
        return self

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            match = self.announce.search(line)
            if match and not self._announced.is_set():
                self.announced(match)
                self._announced.set()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.lines[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills and raises on a hang)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"`{self.name}` did not stop on SIGTERM:\n" + self.log_tail()) from None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class ServerProcess(AnnouncedProcess):
    def __init__(self, *args: str, startup_timeout_s: float = 300.0) -> None:
        command = ["serve", "--port", "0", "--kv-cache-memory", SMALL_KV, "--log-level", "warning", *args]
        super().__init__(command, _ANNOUNCE, startup_timeout_s)
        self.engine_pid = 0

    def announced(self, match: re.Match[str]) -> None:
        self.url, self.engine_pid = match.group(1), int(match.group(2))

    def start(self) -> ServerProcess:
        super().start()
        return self

    def client(self, api_key: str | None = None, timeout: float = 120.0) -> httpx.Client:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample from Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    raise KeyError(name)
