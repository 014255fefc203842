"""A small, real streaming server speaking the OpenAI and Anthropic wire formats, for bench tests.

It runs uvicorn in a thread on a free loopback port. Token counts are words; each generated
token is one stream chunk. It keeps every prompt it has seen and reports as cached the longest
common word prefix with an earlier prompt, rounded down to whole 16-token blocks, the way a
paged prefix cache would, so hit rates measured through it are real consequences of the prompts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BLOCK_SIZE = 16
MODEL_ID = "test-model"


@dataclass(slots=True)
class ServerBehaviour:
    send_usage: bool = True
    first_token_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    fail_every: int | None = None  # every k-th generation request answers HTTP 500


@dataclass(slots=True)
class ServerState:
    behaviour: ServerBehaviour
    seen_prompts: list[list[str]] = field(default_factory=list)
    requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def cached_prefix(self, words: list[str]) -> int:
        best = 0
        for earlier in self.seen_prompts:
            common = 0
            for a, b in zip(earlier, words):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        self.seen_prompts.append(words)
        return best // BLOCK_SIZE * BLOCK_SIZE


def _prompt_words(body: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    if isinstance(body.get("system"), str):
        parts.append(body["system"])
    if isinstance(body.get("prompt"), str):
        parts.append(body["prompt"])
    for message in body.get("messages") or []:
        parts.append(message["content"])
    return " ".join(parts).split()


def _output_len(body: dict[str, Any]) -> int:
    # Without ignore_eos the "model" stops early, at half the budget, like an EOS would.
    budget = int(body["max_tokens"])
    return budget if body.get("ignore_eos") else max(budget // 2, 1)


def _sse(data: dict[str, Any], event: str | None = None) -> str:
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {json.dumps(data)}\n\n"


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI()
    behaviour = state.behaviour

    async def pace(index: int) -> None:
        delay = behaviour.first_token_delay_s if index == 0 else behaviour.chunk_delay_s
        if delay:
            await asyncio.sleep(delay)

    def admit(body: dict[str, Any]) -> JSONResponse | None:
        state.requests += 1
        state.bodies.append(body)
        if behaviour.fail_every and state.requests % behaviour.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    async def openai_stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        words = _prompt_words(body)
        cached = state.cached_prefix(words)
        count = _output_len(body)
        base = {"id": "cmpl-1", "created": int(time.time()), "model": body["model"]}
        if chat:
            base["object"] = "chat.completion.chunk"
            yield _sse(
                {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            )
        else:
            base["object"] = "text_completion"
        for index in range(count):
            await pace(index)
            piece = {"delta": {"content": f"tok{index} "}} if chat else {"text": f"tok{index} "}
            yield _sse({**base, "choices": [{"index": 0, **piece, "finish_reason": None}]})
        last = {"delta": {}} if chat else {"text": ""}
        yield _sse({**base, "choices": [{"index": 0, **last, "finish_reason": "length"}]})
        if behaviour.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(words),
                "completion_tokens": count,
                "total_tokens": len(words) + count,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield _sse({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        return admit(body) or StreamingResponse(openai_stream(body, True), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        return admit(body) or StreamingResponse(openai_stream(body, False), media_type="text/event-stream")

    async def anthropic_stream(body: dict[str, Any]) -> AsyncIterator[str]:
        words = _prompt_words(body)
        cached = state.cached_prefix(words)
        count = _output_len(body)
        usage = {"input_tokens": len(words) - cached, "output_tokens": 1, "cache_read_input_tokens": cached}
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "usage": usage,
        }
        yield _sse({"type": "message_start", "message": message}, "message_start")
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield _sse(block, "content_block_start")
        for index in range(count):
            await pace(index)
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": f"tok{index} "},
            }
            yield _sse(delta, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        final = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"output_tokens": count},
        }
        yield _sse(final, "message_delta")
        yield _sse({"type": "message_stop"}, "message_stop")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await request.json()
        return admit(body) or StreamingResponse(anthropic_stream(body), media_type="text/event-stream")

    return app


@contextmanager
def running_server(behaviour: ServerBehaviour | None = None) -> Iterator[tuple[str, ServerState]]:
    """Serve on 127.0.0.1 on a free port; yields (base_url, state) and stops on exit."""
    state = ServerState(behaviour or ServerBehaviour())
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
