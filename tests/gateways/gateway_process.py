"""The gateways users already run, as real processes in front of our replicas: SGLang Model
Gateway (`smg launch`) and vLLM's router (`vllm-router`), each from its own venv under
build/gateways (`make gateways`), on loopback ports of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx

from deepinfer.distributed.topology import free_port
from tests.server.server_process import wait_until

ROOT = Path(__file__).resolve().parents[2]
BINARIES = {
    "smg": ROOT / "build/gateways/smg/bin/smg",
    "vllm-router": ROOT / "build/gateways/vllm-router/bin/vllm-router",
}


def installed(gateway: str) -> bool:
    return BINARIES[gateway].is_file()


def _command(gateway: str, port: int, workers: list[str], policy: str) -> list[str]:
    metrics_port = str(free_port())  # both default to a fixed one (29000): one gateway per machine
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy]
    common += ["--health-check-interval-secs", "1"]  # a dead replica leaves rotation in seconds
    if gateway == "smg":
        return [str(BINARIES["smg"]), "launch", *common, "--prometheus-port", metrics_port]
    return [str(BINARIES["vllm-router"]), *common, "--prometheus-port", metrics_port]


class GatewayProcess:
    def __init__(self, gateway: str, workers: list[str], policy: str) -> None:
        self.gateway, self.policy = gateway, policy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = _command(gateway, self.port, workers, policy)
        self.log = Path(tempfile.mkdtemp(prefix=f"deepinfer-{gateway}-")) / "log.txt"
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"{self.gateway}-{self.policy}"

    def start(self) -> GatewayProcess:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "NO_COLOR": "1"},
                start_new_session=True,
            )
        return self

    def ready(self) -> bool:
        """Serving once it lists the replicas' model (both wait for their workers' health)."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"{self!r} exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            models = httpx.get(self.url + "/v1/models", timeout=5)
        except httpx.HTTPError:
            return False
        return models.status_code == 200 and bool(models.json().get("data"))

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        assert wait_until(self.ready, timeout_s, 0.5), f"{self!r} was not ready:\n{self.log_tail()}"

    def worker_healthy(self, url: str) -> bool:
        """vllm-router's view of a worker (GET /workers; smg lists only the workers it keeps)."""
        workers = httpx.get(self.url + "/workers", timeout=10).json()["workers"]
        return any(w["url"] == url and w.get("is_healthy", True) for w in workers)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
