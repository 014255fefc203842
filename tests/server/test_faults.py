"""Overload and engine death, on a server of their own (the last tests kill its engine).

The server runs one sequence at a time and admits at most two requests waiting for their first
token: with one long generation running, two more requests wait, and the next is refused.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.server_process import ServerProcess, metric_value, pid_alive, wait_until

HI = [{"role": "user", "content": "Hi"}]
LONG = {"max_tokens": 6000, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server():
    process = ServerProcess("--max-waiting-requests", "2", "--max-num-seqs", "1").start()
    yield process
    process.kill()


def _waiting(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, "deepinfer_api_waiting_requests")


def test_overload_is_429_for_openai_and_529_for_anthropic(small_server) -> None:
    url = small_server.url
    body = {"model": MODEL, "messages": HI, "stream": True, **LONG}
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as running,
    ):
        # Keep the line iterator alive: closing it (as a discarded generator would be) closes the
        # stream, and the server rightly aborts the long request of a client that went away.
        lines = running.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        # The engine is busy with that one; two short requests queue behind it.
        replies: list[httpx.Response] = []
        queued = [
            threading.Thread(
                target=lambda: replies.append(
                    httpx.post(
                        url + "/v1/chat/completions",
                        json={"model": MODEL, "messages": HI, "max_tokens": 1},
                        timeout=120,
                    )
                )
            )
            for _ in range(2)
        ]
        for thread in queued:
            thread.start()
        assert wait_until(lambda: _waiting(url) == 2, 30.0), [(r.status_code, r.text) for r in replies]
        refused = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1}
        )
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "overloaded" in error["message"]
        assert refused.headers["retry-after"] == "1"
        refused = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": HI, "max_tokens": 1})
        assert refused.status_code == 529, refused.text
        assert refused.json() == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": refused.json()["error"]["message"]},
        }
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
                model=MODEL, messages=HI, max_tokens=1
            )
        with pytest.raises(anthropic.OverloadedError):
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
                model=MODEL, messages=HI, max_tokens=1
            )
    # The long stream is gone (client closed it): the queued requests run and succeed.
    for thread in queued:
        thread.join(120)
    assert [r.status_code for r in replies] == [200, 200]
    metrics = httpx.get(url + "/metrics").text
    assert metric_value(metrics, "deepinfer_requests_total", {"outcome": "rejected"}) == 4


def test_engine_death_fails_requests_and_health(small_server) -> None:
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert httpx.get(small_server.url + "/health").status_code == 200
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=6000,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)  # generating
    # A second request, not streamed, waits behind it (one sequence at a time).
    waiting: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: waiting.append(
            httpx.post(
                small_server.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": HI, "max_tokens": 1},
                timeout=60,
            )
        )
    )
    thread.start()
    assert wait_until(lambda: _waiting(small_server.url) == 1, 30.0)
    os.kill(small_server.engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert time.monotonic() - killed_at < 10
    assert "engine" in str(info.value.message)
    thread.join(10)
    assert waiting[0].status_code == 500
    assert (
        waiting[0].json()["error"]["type"] == "server_error"
        and "engine" in waiting[0].json()["error"]["message"]
    )
    health = httpx.get(small_server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    # New work is refused at once, in each API's shape.
    reply = httpx.post(
        small_server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_unavailable"
    reply = httpx.post(
        small_server.url + "/v1/messages",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    assert reply.status_code == 503 and reply.json()["type"] == "error"


def test_sigterm_stops_the_server_cleanly(small_server) -> None:
    assert small_server.stop(timeout_s=30) == 0, small_server.log_tail()
    assert wait_until(lambda: not pid_alive(small_server.engine_pid), 5.0)
