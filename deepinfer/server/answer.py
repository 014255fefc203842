"""The answer to a generating request: SSE frames as tokens arrive, or one body at the end.

Every route hands over the same three things: the GenerationStream of its engine requests,
the Choices that turn deltas into canonical events, and an EventSink (its API's encoder); and
optionally `on_close`, awaited once the answer is complete and before its last frames (or its
body) go out: a stored response is saved before its client can ask for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.frontend.client import EngineDeadError, GenerationStream
from deepinfer.frontend.output_processor import SequenceDelta
from deepinfer.recipe.api import GenerationError
from deepinfer.recipe.events import Event
from deepinfer.server.errors import ApiError
from deepinfer.server.generation import Choices
from deepinfer.server.http_io import EventStreamResponse, until_disconnect
from deepinfer.server.keepalive import with_ticks

OnClose = Callable[[], Awaitable[None]]


class EventSink(Protocol):
    """An API encoder behind one interface: frames out for streams, a body for the rest."""

    def opening(self) -> list[str]:
        """Frames a stream sends before the engine produced anything (a long prefill can take
        longer than a client's idle timeout)."""
        ...

    def first_output(self, delta: SequenceDelta) -> list[str]: ...

    def keepalive(self) -> list[str]:
        """Frames for a stream silent for the keep-alive interval; clients must ignore them."""
        ...

    def feed(self, index: int, event: Event) -> list[str]: ...

    def close(self) -> list[str]: ...

    def body(self) -> dict[str, Any]: ...


async def stream_frames(
    stream: GenerationStream,
    choices: Choices,
    sink: EventSink,
    on_close: OnClose | None = None,
    *,
    keepalive_s: float,
) -> AsyncIterator[str]:
    """SSE text for a streamed request: one chunk of frames per wake-up, and keep-alive frames
    whenever `keepalive_s` passes without one. Closing the iterator early (client gone) aborts
    what is still running."""
    started = False
    try:
        try:
            opening = sink.opening()
            if opening:
                yield "".join(opening)
            async with (
                aclosing(stream.batches()) as batches,
                aclosing(with_ticks(batches, keepalive_s)) as ticking,
            ):
                async for batch in ticking:
                    if batch is None:
                        keepalive = sink.keepalive()
                        if keepalive:
                            yield "".join(keepalive)
                        continue
                    frames: list[str] = []
                    if not started:
                        started = True
                        frames.extend(sink.first_output(batch[0]))
                    for delta in batch:
                        for index, event in choices.events(delta):
                            frames.extend(sink.feed(index, event))
                    if frames:
                        yield "".join(frames)
        except EngineDeadError as error:
            frames = []
            for index, event in choices.fail(str(error)):
                frames.extend(sink.feed(index, event))
            if frames:
                yield "".join(frames)
        closing = sink.close()
        if on_close is not None:
            await on_close()
        yield "".join(closing)
    finally:
        stream.abort()


async def collect_body(
    stream: GenerationStream, choices: Choices, sink: EventSink, on_close: OnClose | None = None
) -> dict[str, Any]:
    """The whole answer of a request that is not streamed; GenerationError if it failed."""
    started = False
    try:
        async for batch in stream.batches():
            if not started:
                started = True
                sink.first_output(batch[0])
            for delta in batch:
                for index, event in choices.events(delta):
                    sink.feed(index, event)
    except EngineDeadError as error:
        for index, event in choices.fail(str(error)):
            sink.feed(index, event)
    finally:
        stream.abort()
    sink.close()
    if on_close is not None:
        await on_close()
    return sink.body()


async def respond(
    request: Request,
    stream: GenerationStream,
    choices: Choices,
    sink: EventSink,
    *,
    streaming: bool,
    on_close: OnClose | None = None,
) -> Response:
    """The HTTP answer: SSE frames as they come, or the whole body once generation ends."""
    if streaming:
        keepalive_s = request.app.state.server.config.stream_keepalive
        frames = stream_frames(stream, choices, sink, on_close, keepalive_s=keepalive_s)
        return EventStreamResponse(frames, on_disconnect=stream.abort)
    try:
        body = await until_disconnect(request, collect_body(stream, choices, sink, on_close), stream.abort)
    except GenerationError as error:
        raise ApiError(500, str(error), code="generation_failed") from None
    if body is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)
