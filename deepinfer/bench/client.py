"""One streamed request against an OpenAI- or Anthropic-compatible endpoint, timed per chunk.

Supports ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI SSE with ``data:`` lines and
``[DONE]``) and ``/v1/messages`` (Anthropic SSE events). A chunk that carries generated text
(answer, reasoning or tool-call arguments) counts as a token arrival: the first one fixes TTFT,
the gaps between later ones are the inter-token latencies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from deepinfer.bench.datasets import BenchRequest
from deepinfer.bench.stats import time_per_output_token

API_NAMES: tuple[str, ...] = ("chat", "completions", "messages")
DEFAULT_ENDPOINTS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}
ANTHROPIC_VERSION = "2023-06-01"


class _ServerError(Exception):
    """The server answered, but with an error (status, error event, or no text at all)."""


@dataclass(slots=True)
class RequestSettings:
    """How every request of a run is sent (same for all requests)."""

    api: str
    url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times are seconds, ``start_s`` is relative to the run start."""

    request_id: str
    session_id: int
    turn: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    content_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    approx_input_tokens: int = 0
    requested_output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.e2e_s is None or self.ttft_s is None:
            return None
        return time_per_output_token(self.e2e_s, self.ttft_s, self.output_tokens)

    def to_dict(self, include_itl: bool) -> dict[str, Any]:
        record = {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "turn": self.turn,
            "success": self.success,
            "error": self.error,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "content_chunks": self.content_chunks,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "approx_input_tokens": self.approx_input_tokens,
            "requested_output_tokens": self.requested_output_tokens,
        }
        if include_itl:
            record["itl_s"] = self.itl_s
        return record


def endpoint_url(base_url: str, api: str, endpoint: str | None = None) -> str:
    """Join the base URL and the API's path; a base URL that already ends in /v1 is accepted."""
    if api not in API_NAMES:
        raise ValueError(f"api must be one of {', '.join(API_NAMES)}, got {api!r}")
    base = base_url.rstrip("/")
    path = endpoint or DEFAULT_ENDPOINTS[api]
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[len("/v1") :]
    return base + path


def build_payload(settings: RequestSettings, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for one request; ``max_tokens`` with ``ignore_eos`` fixes the output length."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": request.output_len,
        "temperature": settings.temperature,
        "stream": True,
    }
    if settings.api == "chat":
        system = [{"role": "system", "content": request.system}] if request.system else []
        body["messages"] = system + request.messages
    elif settings.api == "completions":
        body["prompt"] = request.as_text_prompt()
    else:
        if request.system:
            body["system"] = request.system
        body["messages"] = request.messages
    if settings.api != "messages":
        body["stream_options"] = {"include_usage": True}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


def build_headers(settings: RequestSettings) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if settings.api == "messages":
        headers["anthropic-version"] = ANTHROPIC_VERSION
        if settings.api_key:
            headers["x-api-key"] = settings.api_key
    elif settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
    return headers


class _StreamState:
    """Accumulates one response's chunk arrivals and usage, whatever the wire format."""

    def __init__(self, result: RequestResult, sent_at: float) -> None:
        self.result = result
        self.sent_at = sent_at
        self.last_arrival: float | None = None
        self.usage_output_tokens: int | None = None

    def on_content(self, now: float) -> None:
        if self.last_arrival is None:
            self.result.ttft_s = now - self.sent_at
        else:
            self.result.itl_s.append(now - self.last_arrival)
        self.last_arrival = now
        self.result.content_chunks += 1

    def on_openai_usage(self, usage: Mapping[str, Any]) -> None:
        if usage.get("completion_tokens") is not None:
            self.usage_output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            self.result.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.result.cached_tokens = int(details["cached_tokens"])

    def on_anthropic_usage(self, usage: Mapping[str, Any]) -> None:
        if usage.get("output_tokens") is not None:
            self.usage_output_tokens = int(usage["output_tokens"])
        if usage.get("input_tokens") is not None:
            # Anthropic's input_tokens excludes the cached part; the prompt is all three.
            cache_read = int(usage.get("cache_read_input_tokens") or 0)
            cache_write = int(usage.get("cache_creation_input_tokens") or 0)
            self.result.prompt_tokens = int(usage["input_tokens"]) + cache_read + cache_write
        if usage.get("cache_read_input_tokens") is not None:
            self.result.cached_tokens = int(usage["cache_read_input_tokens"])


def _openai_chunk_text(chunk: Mapping[str, Any]) -> bool:
    """Whether an OpenAI stream chunk carries generated text (answer, reasoning or tool call)."""
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
        for call in delta.get("tool_calls") or []:
            if (call.get("function") or {}).get("arguments"):
                return True
    return False


def _handle_openai_event(state: _StreamState, data: Mapping[str, Any], now: float) -> None:
    if "error" in data:
        raise _ServerError(json.dumps(data["error"])[:500])
    if _openai_chunk_text(data):
        state.on_content(now)
    if data.get("usage"):
        state.on_openai_usage(data["usage"])


def _handle_anthropic_event(state: _StreamState, data: Mapping[str, Any], now: float) -> None:
    kind = data.get("type")
    if kind == "error":
        raise _ServerError(json.dumps(data.get("error", data))[:500])
    if kind == "message_start":
        state.on_anthropic_usage((data.get("message") or {}).get("usage") or {})
    elif kind == "content_block_delta":
        delta = data.get("delta") or {}
        if delta.get("text") or delta.get("thinking") or delta.get("partial_json"):
            state.on_content(now)
    elif kind == "message_delta":
        state.on_anthropic_usage(data.get("usage") or {})


async def send_request(
    client: httpx.AsyncClient, settings: RequestSettings, request: BenchRequest, run_start: float
) -> RequestResult:
    """Send one streamed request and time it; failures are recorded, never raised."""
    result = RequestResult(
        request_id=request.request_id,
        session_id=request.session_id,
        turn=request.turn,
        approx_input_tokens=request.approx_input_tokens,
        requested_output_tokens=request.output_len,
    )
    handle = _handle_anthropic_event if settings.api == "messages" else _handle_openai_event
    sent_at = time.perf_counter()
    result.start_s = sent_at - run_start
    state = _StreamState(result, sent_at)
    try:
        async with client.stream(
            "POST", settings.url, json=build_payload(settings, request), headers=build_headers(settings)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                raise _ServerError(f"HTTP {response.status_code}: {body[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                if payload:
                    handle(state, json.loads(payload), time.perf_counter())
        result.e2e_s = time.perf_counter() - sent_at
        if state.usage_output_tokens is not None:
            result.output_tokens = state.usage_output_tokens
            result.output_tokens_source = "usage"
        else:
            result.output_tokens = result.content_chunks
        if result.ttft_s is None:
            raise _ServerError("the stream ended without any generated text")
        result.success = True
    except _ServerError as exc:
        result.error = str(exc)
    # A malformed stream (bad JSON, a chunk of the wrong shape) fails this request, not the run.
    except (httpx.HTTPError, httpx.StreamError, ValueError, TypeError, AttributeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
