"""Real processes on loopback for the disaggregation and router tests: replicas (`deepinfer
serve`, small KV budgets, one thread each), a `deepinfer router` in front, started together,
all holding one cluster key (prefill/decode handoffs are signed with it)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from deepinfer.security import read_cluster_key
from deepinfer.security.signing import PEER_HEADER, peer_token, sign_handoff
from tests.server.server_process import AnnouncedProcess, ServerProcess, pid_alive, wait_until

MODEL = "SmolLM2-135M-Instruct"
SMALL = ("--kv-cache-memory", "64MiB", "--num-threads", "1", "--max-num-batched-tokens", "512")
_ROUTER = re.compile(r"DeepInfer router at (http://\S+) ")


@functools.cache
def cluster_key_file() -> str:
    """A private key file shared by this test process's clusters, removed when it exits."""
    directory = tempfile.mkdtemp(prefix="deepinfer-cluster-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = os.path.join(directory, "cluster.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_hex(32))
    return path


def cluster_key() -> bytes:
    return read_cluster_key(cluster_key_file())


def peer_headers(method: str, path: str) -> dict[str, str]:
    """What a router sends on a peer-only route."""
    return {PEER_HEADER: peer_token(cluster_key(), method, path)}


def signed_handoff(**fields: str) -> str:
    """An x-deepinfer-kv-transfer header as the router writes it, signed with the cluster key."""
    signature = sign_handoff(
        cluster_key(), fields.get("transfer_id"), fields.get("address"), fields.get("error")
    )
    return json.dumps({**fields, "signature": signature})


def replica(*args: str) -> ServerProcess:
    return ServerProcess(
        *SMALL, "--kv-events-endpoint", "tcp://127.0.0.1:0", "--cluster-key-file", cluster_key_file(), *args
    )


class RouterProcess(AnnouncedProcess):
    def __init__(self, *args: str, startup_timeout_s: float = 120.0) -> None:
        command = ["router", "--port", "0", "--log-level", "warning", "--health-interval", "0.5"]
        command += ["--cluster-key-file", cluster_key_file(), *args]
        super().__init__(command, _ROUTER, startup_timeout_s)

    def start(self) -> RouterProcess:
        super().start()
        return self

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert wait_until(lambda: self.health()["status"] == "ok", timeout_s), self.health()


def start_all(servers: list[ServerProcess]) -> None:
    """Start replicas side by side (each loads the model); if one fails, stop them all."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.kill()
        raise next(e for e in errors if e is not None)


def stop_all(servers: list[ServerProcess]) -> None:
    for s in servers:
        s.kill()
    for s in servers:
        if s.engine_pid:
            wait_until(lambda s=s: not pid_alive(s.engine_pid), 10.0)


def engine_info(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(
        server.url + "/v1/engine_info", headers=peer_headers("GET", "/v1/engine_info"), timeout=10
    ).json()


def blocks_in_use(server: ServerProcess) -> int:
    load = engine_info(server)["load"]
    return load["num_blocks"] - load["num_free_blocks"]


def wait_all_blocks_free(servers: list[ServerProcess], timeout_s: float = 15.0) -> None:
    """Once requests end, no engine holds a KV block (leases included)."""
    assert wait_until(lambda: all(blocks_in_use(s) == 0 for s in servers), timeout_s, 0.2), {
        s.url: blocks_in_use(s) for s in servers
    }


def cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens served from the prefix cache, in any API's usage."""
    if "cache_read_input_tokens" in usage:
        return int(usage["cache_read_input_tokens"] or 0)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def reusable(prompt_tokens: int, block_size: int = 16) -> int:
    """Prompt tokens a handoff carries: every full block but the last token's."""
    return (prompt_tokens - 1) // block_size * block_size


def elapsed(since: float) -> float:
    return time.monotonic() - since
