"""Many clients at once, and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

from tests.server.conftest import API_KEY, MODEL
from tests.server.server_process import metric_value, wait_until

NUM_CLIENTS = 64
MAX_TOKENS = 4


async def _one_stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, list]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Client {i}: say something."}],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
    )
    return f"client {i}", [chunk async for chunk in stream]


def _check_well_formed(name: str, chunks: list) -> None:
    assert chunks, name
    assert len({c.id for c in chunks}) == 1, name  # one completion id throughout
    first, last = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant", name
    body = chunks[:-1]
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"]), (name, finishes)
    assert body[-1].choices[0].finish_reason is not None, name  # nothing after the finish chunk
    assert last.choices == [] and last.usage is not None, name  # the usage chunk closes the stream
    assert 1 <= last.usage.completion_tokens <= MAX_TOKENS, name
    if finishes == ["length"]:
        assert last.usage.completion_tokens == MAX_TOKENS, name


METRICS = (
    "deepinfer_time_to_first_token_seconds_count",
    "deepinfer_e2e_request_latency_seconds_count",
    "deepinfer_prompt_tokens_total",
    "deepinfer_generation_tokens_total",
)


def _counters(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {name: metric_value(text, name) for name in METRICS}


def test_64_concurrent_streams(server, http: httpx.Client) -> None:
    before = _counters(http)

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(_one_stream(client, i) for i in range(NUM_CLIENTS)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == NUM_CLIENTS
    for name, chunks in results:
        _check_well_formed(name, chunks)
    # Every request is in the latency histograms and token counters, exactly once.
    after = _counters(http)
    usages = [chunks[-1].usage for _, chunks in results]
    assert after["deepinfer_time_to_first_token_seconds_count"] - before[METRICS[0]] == NUM_CLIENTS
    assert after["deepinfer_e2e_request_latency_seconds_count"] - before[METRICS[1]] == NUM_CLIENTS
    assert after["deepinfer_prompt_tokens_total"] - before[METRICS[2]] == sum(u.prompt_tokens for u in usages)
    assert after["deepinfer_generation_tokens_total"] - before[METRICS[3]] == sum(
        u.completion_tokens for u in usages
    )


def _used_blocks(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "deepinfer_kv_cache_used_blocks")


def _aborts(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "deepinfer_requests_total", {"outcome": "abort"})


def test_disconnected_streams_free_their_blocks(server, http: httpx.Client) -> None:
    aborts_before = _aborts(http)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        streams = [c.stream("POST", "/v1/chat/completions", json=body) for _ in range(8)]
        responses = [s.__enter__() for s in streams]
        try:
            for response in responses:
                assert response.status_code == 200
                # Read until the first generated text: the request is running in the engine.
                for line in response.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                        "content"
                    ):
                        break
            # Polled like the checks below: once in a full-suite run the first read gave 0 with all
            # eight streams running (not reproduced alone).
            assert wait_until(lambda: _used_blocks(http) > 0, 10.0), _used_blocks(http)
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)  # closes the connection mid-stream
    # Every abort reaches the engine, and the engine reports all its blocks free again.
    assert wait_until(lambda: _aborts(http) - aborts_before == 8, 30.0), _aborts(http) - aborts_before
    assert wait_until(lambda: _used_blocks(http) == 0, 30.0), _used_blocks(http)


def test_disconnected_non_streamed_request_is_aborted(server, http: httpx.Client) -> None:
    aborts_before = _aborts(http)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 6000,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=3) as c:
        try:
            c.post("/v1/chat/completions", json=body)
        except httpx.TimeoutException:
            pass  # the client gives up after 3 s and closes its connection
        else:
            raise AssertionError("6000 tokens cannot have been generated in 3 s")
    assert wait_until(lambda: _aborts(http) - aborts_before == 1, 30.0)
    assert wait_until(lambda: _used_blocks(http) == 0, 30.0), _used_blocks(http)
