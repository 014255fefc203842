"""Reading bodies (size limit, JSON) and answering with streams that notice a client leaving.

A client that disconnects must free its engine resources at once, streaming or not, so both
answers watch the ASGI `receive` channel for `http.disconnect` next to the work itself (no
polling: the server wakes the waiter when the connection closes).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from deepinfer.server.errors import ApiError

T = TypeVar("T")

# Real bodies (a JSON schema, tool arguments) nest a few dozen levels at most; deeper ones would
# only exhaust the stack of whatever walks them later (pydantic, the recipe, grammar compilers).
MAX_JSON_DEPTH = 100
PATH_NAMES = 4  # names of a too-deep field's path that an error quotes
THREAD_DECODE_BYTES = 1 << 20  # decoding a body this large takes milliseconds: off the event loop
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a whole string, or a bracket
SEND_STALL_S = 60.0  # a stream whose client reads nothing for this long is cut


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 past `limit` bytes (read no further), 400 if not JSON or
    nested deeper than MAX_JSON_DEPTH. A large body is decoded on a thread, so the event loop
    keeps answering other requests meanwhile."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) < THREAD_DECODE_BYTES:
        return decode_json(data)
    return await asyncio.to_thread(decode_json, data)


def decode_json(data: bytes) -> Any:
    """A body's JSON, refused (400 naming where) when empty, invalid or nested too deeply."""
    if not data.strip():
        raise ApiError(400, "body: expected a JSON object, got an empty body", param="body")
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as error:
        raise ApiError(400, f"body: invalid JSON: {error}", param="body") from None
    except RecursionError:  # msgspec's own guard, deeper than ours
        where = deep_top_field(data)
        raise ApiError(
            400, f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param=where
        ) from None
    too_deep = deepest_path(body, MAX_JSON_DEPTH)
    if too_deep is not None:
        raise ApiError(400, f"{too_deep}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param=too_deep)
    return body


def deepest_path(value: Any, limit: int) -> str | None:
    """Where `value` first nests deeper than `limit` containers (a field path such as
    `response_format.json_schema`, cut after a few names), or None. Iterative, so that the
    check itself cannot overflow the stack it protects."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            return _field_path(path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, dict | list):
                # Only the first names are kept: enough to say which field, not a 1,000-step path.
                stack.append((child, depth + 1, (*path, key) if len(path) < PATH_NAMES else path))
    return None


def deep_top_field(data: bytes) -> str:
    """The top-level field of a JSON text that nests deeper than MAX_JSON_DEPTH ("body" when
    the text itself does): found by scanning its strings and brackets, for text too deep to
    decode. Strings are matched whole by the regex, so brackets inside them do not count."""
    depth, key = 0, "body"
    for match in _JSON_TOKENS.finditer(data):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif token in (b"]", b"}"):
            depth -= 1
        elif depth == 1 and data[match.end() : match.end() + 64].lstrip()[:1] == b":":
            key = token[1:-1].decode("utf-8", "replace")
    return "body"


def _field_path(path: tuple[str | int, ...]) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "body"


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]
) -> T | None:
    """Await `work`; if the client goes away first, call `on_disconnect`, cancel it, return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            on_disconnect()
            return None
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


class EventStreamResponse(StreamingResponse):
    """Server-sent events from an async iterator of already-framed text.

    The frames are sent as they come; when the client disconnects, `on_disconnect` runs at
    once (it aborts the generation) and the iterator is closed.
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[str], on_disconnect: Callable[[], None]) -> None:
        super().__init__(
            frames,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            media_type=self.media_type,
        )
        self.frames = frames
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            error = pump.exception() if pump.done() else None
            # OSError: a send to a closed socket, or ClientStalled.
            if not pump.done() or isinstance(error, OSError):
                self.on_disconnect()
            elif error is not None:
                raise error
        finally:
            for task in (pump, watcher):
                task.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)
            await self.frames.aclose()  # type: ignore[attr-defined]

    async def _pump(self, send: Send) -> None:
        async for text in self.frames:
            await _send_within(
                send, {"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True}
            )
        await _send_within(send, {"type": "http.response.body", "body": b"", "more_body": False})


class ClientStalled(ConnectionError):
    """The client read nothing for SEND_STALL_S: treated as gone (its generation is aborted)."""


async def _send_within(send: Send, message: Message) -> None:
    # uvicorn's send waits while the socket's buffers are full: without a bound, a client that
    # never reads would keep its generation running and its deltas queued for as long as it likes.
    try:
        await asyncio.wait_for(send(message), SEND_STALL_S)
    except TimeoutError:
        raise ClientStalled(f"the client read nothing for {SEND_STALL_S:.0f} s") from None
