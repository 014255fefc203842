"""Test harness: real SDK clients talking to the recipe codec over an in-process HTTP transport.

The transport hands each request the SDK sends to a handler that runs our parser and encoder,
so the SDKs' own request building, SSE decoding, strict response validation and stream
accumulators are what the tests check against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import openai

from deepinfer.recipe.events import (
    Finish,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TopLogprob,
    Usage,
)

BASE_URL = "http://deepinfer.test"

Handler = Callable[[dict[str, Any]], httpx2.Response]


class Recorder:
    """Keeps the JSON bodies the SDK sent, for request-parsing assertions."""

    def __init__(self, reply: Handler) -> None:
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        return self.reply(body)


def sse_response(frames: list[str]) -> httpx2.Response:
    return httpx2.Response(
        200, content="".join(frames).encode("utf-8"), headers={"content-type": "text/event-stream"}
    )


def json_response(body: dict[str, Any], status: int = 200) -> httpx2.Response:
    return httpx2.Response(status, json=body)


def openai_client(recorder: Recorder) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test",
        base_url=f"{BASE_URL}/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(recorder)),
        max_retries=0,
        _strict_response_validation=True,
    )


def anthropic_client(recorder: Recorder) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="sk-ant-test",
        base_url=BASE_URL,
        http_client=httpx2.Client(transport=httpx2.MockTransport(recorder)),
        max_retries=0,
        _strict_response_validation=True,
    )


def decode_sse(frames: list[str]) -> list[tuple[str | None, str]]:
    """(event name, data) pairs, decoded by the OpenAI SDK's own SSE decoder."""
    from openai._streaming import SSEDecoder

    decoded = SSEDecoder().iter_bytes(iter(["".join(frames).encode("utf-8")]))
    return [(sse.event, sse.data) for sse in decoded]


WEATHER_TOOL_ARGS = '{"city": "Paris", "unit": "celsius"}'


def reasoning_text_tool_events() -> list[Any]:
    """A typical agent turn: think, say something, call a tool."""
    return [
        ReasoningDelta("The user wants"),
        ReasoningDelta(" the weather."),
        TextDelta("Let me check"),
        TextDelta(" that for you."),
        ToolCallStart(index=0, id="call_w1", name="get_weather"),
        ToolCallArgsDelta(index=0, delta='{"city": '),
        ToolCallArgsDelta(index=0, delta='"Paris", "unit": "celsius"}'),
        ToolCallEnd(index=0, arguments=WEATHER_TOOL_ARGS),
        Finish("tool_calls"),
        Usage(prompt_tokens=120, completion_tokens=30, cached_tokens=64, reasoning_tokens=6),
    ]


def text_events(text: str = "Hello there, friend!", *, logprobs: bool = False) -> list[Any]:
    pieces = [text[:5], text[5:11], text[11:]]
    events: list[Any] = []
    for i, piece in enumerate(pieces):
        events.append(TextDelta(piece))
        if logprobs:
            top = [TopLogprob(token=piece, logprob=-0.1 * i), TopLogprob(token="x", logprob=-3.0)]
            events.append(Logprobs([TokenLogprob(token=piece, logprob=-0.1 * i, top=top)]))
    events += [Finish("stop"), Usage(prompt_tokens=10, completion_tokens=3)]
    return events
