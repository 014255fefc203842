"""Servers for the edge tests: real `deepinfer serve` processes on loopback, two tenants each.

`tenants` is started with the flags every release had (two API keys, nothing else), so what it
shows is the default a deployment gets; `guarded` adds an admin key and a short header deadline.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.server.server_process import ServerProcess

TENANT_A = "sk-edge-tenant-a"
TENANT_B = "sk-edge-tenant-b"
ADMIN_KEY = "sk-edge-admin"
MODEL = "SmolLM2-135M-Instruct"
HEADER_TIMEOUT_S = 2


@pytest.fixture(scope="session")
def tenants():
    process = ServerProcess("--api-key", TENANT_A, "--api-key", TENANT_B).start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def guarded():
    process = ServerProcess(
        "--api-key",
        TENANT_A,
        "--api-key",
        TENANT_B,
        "--admin-key",
        ADMIN_KEY,
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
    ).start()
    yield process
    process.stop()


def as_key(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def error_of(reply: httpx.Response, status: int) -> dict:
    """The error of an OpenAI-shaped answer, checked to have `status`."""
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_connection(url: str, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(address(url), timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock
