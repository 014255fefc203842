"""Streams stay alive through a long prefill: a real server whose keep-alive interval
(`--stream-keepalive`) is far shorter than the prefill of a long prompt.

Messages streams send `message_start` and then `ping` events before the first content; the
OpenAI-shaped streams send SSE comment lines. The real SDKs, in their default modes, read the
same streams to the end and ignore the keep-alives. A client that leaves during the silence
still frees its request.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.server_process import ServerProcess, metric_value, wait_until

KEEPALIVE_S = 0.05
# About 600 prompt tokens: a prefill of a second or more on a CPU, many keep-alive intervals.
LINES = 40


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--api-key", API_KEY, "--public-metrics", "--stream-keepalive", str(KEEPALIVE_S)
    ).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
def http(server):
    with server.client(API_KEY) as client:
        yield client


def long_prompt(lines: int = LINES) -> str:
    """A prompt no earlier request shares a prefix with (its first line differs): its prefill is
    not a cache hit."""
    records = (f"Record {i}: crate {i * 13 % 97} moved to shelf {i % 31}." for i in range(lines))
    return f"Log {uuid.uuid4().hex}\n" + "\n".join(records) + "\nWhich shelf holds crate 5? Answer briefly."


def sse_items(response: httpx.Response) -> list[tuple[str, str]]:
    """(kind, text) of each SSE item in arrival order: ("comment", text), ("event", name) or
    ("data", json text)."""
    items: list[tuple[str, str]] = []
    for line in response.iter_lines():
        if line.startswith(":"):
            items.append(("comment", line[1:].strip()))
        elif line.startswith("event: "):
            items.append(("event", line[7:]))
        elif line.startswith("data: "):
            items.append(("data", line[6:]))
    return items


def test_messages_stream_starts_and_pings_before_the_first_content(server, http: httpx.Client) -> None:
    prompt = long_prompt()
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        items = sse_items(response)
    events = [json.loads(text)["type"] for kind, text in items if kind == "data"]
    names = [text for kind, text in items if kind == "event"]
    assert names == events  # every data line is named by its event line
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    first_content = events.index("content_block_start")
    pings = events[1:first_content]
    # The prefill lasted many intervals: pings only, until the content.
    assert len(pings) >= 2 and set(pings) == {"ping"}, events[:first_content]
    assert not any(kind == "comment" for kind, _ in items)  # Messages keeps alive with events only
    # message_start went out before the prefill's cache hit was known; the final usage has it.
    datas = [json.loads(text) for kind, text in items if kind == "data"]
    delta = next(d for d in datas if d["type"] == "message_delta")
    counted = http.post(
        "/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]}
    ).json()
    usage = delta["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted["input_tokens"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_openai_streams_send_comments_before_the_first_chunk(http: httpx.Client, route: str) -> None:
    prompt = long_prompt()
    body = {"model": MODEL, "max_tokens": 8, "stream": True}
    if route == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        items = sse_items(response)
    first_data = next(i for i, (kind, _) in enumerate(items) if kind == "data")
    assert first_data >= 2 and items[:first_data] == [("comment", "keep-alive")] * first_data, items[:5]
    assert items[-1] == ("data", "[DONE]")


def test_responses_stream_sends_created_then_comments(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_output_tokens": 16, "stream": True, "input": long_prompt()}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        items = sse_items(response)
    events = [json.loads(text)["type"] for kind, text in items if kind == "data"]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    # Its opening events go out at once, then comments until the first output.
    first_comment = items.index(("comment", "keep-alive"))
    opening = [json.loads(text)["type"] for kind, text in items[:first_comment] if kind == "data"]
    assert opening == ["response.created", "response.in_progress"], opening
    silence = [kind for kind, _ in items[first_comment:]]
    assert silence.index("event") >= 2 and set(silence[: silence.index("event")]) == {"comment"}, items[:8]


def test_the_sdks_ignore_the_keepalives(server) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120.0)
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": long_prompt()}]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, max_tokens=8, stream=True, messages=[{"role": "user", "content": long_prompt()}]
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    events = list(oai.responses.create(model=MODEL, max_output_tokens=16, stream=True, input=long_prompt()))
    assert events[0].type == "response.created"
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete"), final.type
    assert final.response.usage is not None and final.response.usage.output_tokens > 0


def _metric(http: httpx.Client, name: str, labels: dict[str, str] | None = None) -> float:
    return metric_value(http.get("/metrics").text, name, labels)


def test_a_client_leaving_during_the_silence_frees_its_request(server, http: httpx.Client) -> None:
    aborts_before = _metric(http, "deepinfer_requests_total", {"outcome": "abort"})
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": long_prompt(LINES * 3)}],  # seconds more of prefill
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        for line in response.iter_lines():
            if line == "event: ping":
                break  # the prefill is under way and the client leaves
    assert wait_until(
        lambda: _metric(http, "deepinfer_requests_total", {"outcome": "abort"}) - aborts_before == 1, 30.0
    )
    assert wait_until(lambda: _metric(http, "deepinfer_kv_cache_used_blocks") == 0, 30.0)
