"""Reading bodies (size limit, JSON) and answering with streams that notice a client leaving.

A client that disconnects must free its engine resources at once, streaming or not, so both
answers watch the ASGI `receive` channel for `http.disconnect` next to the work itself (no
polling: the server wakes the waiter when the connection closes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deepinfer.server.errors import ApiError

T = TypeVar("T")


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 past `limit` bytes (read no further), 400 if not JSON."""
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
    if not data.strip():
        raise ApiError(400, "body: expected a JSON object, got an empty body", param="body")
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as error:
        raise ApiError(400, f"body: invalid JSON: {error}", param="body") from None


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
            if not pump.done() or isinstance(error, OSError):  # OSError: a send to a closed socket
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
            await send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
