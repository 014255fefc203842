"""One real server for the SDK, error and concurrency tests (started once, stopped with SIGTERM)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.server_process import ServerProcess, pid_alive, wait_until

API_KEY = "sk-deepinfer-test"
OTHER_KEY = "sk-deepinfer-other-tenant"
ADMIN_KEY = "sk-deepinfer-admin"
MODEL = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 1 << 20
# Short, so the pathological-schema test reaches the compile timeout quickly (real schemas
# compile in milliseconds).
GRAMMAR_COMPILE_TIMEOUT_S = 1


@pytest.fixture(scope="session")
def server():
    process = ServerProcess(
        "--api-key",
        API_KEY,
        "--api-key",
        OTHER_KEY,
        "--admin-key",
        ADMIN_KEY,
        "--public-metrics",  # the tests read /metrics with the API key
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--grammar-compile-timeout",
        str(GRAMMAR_COMPILE_TIMEOUT_S),
    ).start()
    yield process
    code = process.stop()
    # A clean shutdown: exit code 0 and no orphaned engine process.
    assert code == 0, process.log_tail()
    # The engine left on its own after the Shutdown message (not terminated at the deadline).
    assert "did not stop" not in "\n".join(process.lines), process.log_tail()
    assert wait_until(lambda: not pid_alive(process.engine_pid), 10.0)


@pytest.fixture(scope="session")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key=API_KEY,
        max_retries=0,
        timeout=120.0,
        _strict_response_validation=True,
    )


@pytest.fixture(scope="session")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120.0, _strict_response_validation=True
    )


@pytest.fixture(scope="session")
def http(server):
    with server.client(API_KEY) as client:
        yield client
