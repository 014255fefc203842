"""Forwarding one request to one replica and relaying its answer.

Bodies and streams pass through byte for byte (`aiter_raw`: no decoding, no re-encoding); a
stream is relayed in whole SSE frames, so if the replica dies mid-stream the client gets what
was complete and then one error event in its API's shape, never half a frame and never a hang:
every read races the replica's `dead` event, set when the health checks take it out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx

from deepinfer.recipe.api import anthropic_error_body, openai_error_body
from deepinfer.recipe.api.sse import SSE_DONE, sse_frame
from deepinfer.router.prompt import MESSAGES, RESPONSES

T = TypeVar("T")

# Not forwarded either way: they describe one connection, not the request.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


# Only the router sets these on a request to a replica: a client's own would let it point a
# decode engine at KV of its choosing.
ROUTER_ONLY = frozenset({"x-deepinfer-kv-transfer"})


class UpstreamFailed(Exception):
    """The replica did not answer (refused, reset, timed out, died): nothing reached the client."""


def forwarded_headers(headers: list[tuple[str, str]], extra: dict[str, str]) -> list[tuple[str, str]]:
    dropped = HOP_BY_HOP | ROUTER_ONLY
    kept = [(k, v) for k, v in headers if k.lower() not in dropped and k.lower() not in extra]
    return kept + list(extra.items())


def answer_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}


async def until_dead(work: Awaitable[T], dead: asyncio.Event) -> T:
    """`work`, unless the replica is declared dead first (then UpstreamFailed)."""
    task = asyncio.ensure_future(work)
    if dead.is_set():
        task.cancel()
        raise UpstreamFailed("the replica is out of rotation")
    waiter = asyncio.ensure_future(dead.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        raise UpstreamFailed("the replica stopped answering (out of rotation)")
    return task.result()


def stream_error_frame(path: str, message: str) -> bytes:
    """The error event that ends a stream cut short, in the shape of the stream's API."""
    if path.startswith(MESSAGES):
        body = anthropic_error_body(message, status=502)
        return sse_frame(body, event="error").encode()
    if path.startswith(RESPONSES):
        event = {
            "type": "error",
            "code": "server_error",
            "message": message,
            "param": None,
            "sequence_number": 0,
        }
        return sse_frame(event, event="error").encode()
    return (sse_frame(openai_error_body(message, status=502)) + SSE_DONE).encode()


async def relay_stream(
    upstream: httpx.Response,
    path: str,
    dead: asyncio.Event,
    on_end: Callable[[str | None], None],
) -> AsyncIterator[bytes]:
    """The replica's SSE bytes as they arrive, cut at frame boundaries; an error event if it
    fails. `on_end(error)` runs once, however the stream ends (also when the client leaves)."""
    chunks = upstream.aiter_raw()
    pending = b""
    error: str | None = None
    try:
        while True:
            try:
                chunk = await until_dead(chunks.__anext__(), dead)
            except StopAsyncIteration:
                break
            except (httpx.HTTPError, UpstreamFailed) as failure:
                error = f"{type(failure).__name__}: {failure}"  # for the log, which names the replica
                break
            pending += chunk
            end = pending.rfind(b"\n\n")
            if end >= 0:
                complete, pending = pending[: end + 2], pending[end + 2 :]
                yield complete
        if error is not None:
            # The client learns that the stream broke, not where: replicas' addresses are internal.
            yield stream_error_frame(path, "the replica serving this stream failed mid-stream")
        elif pending:
            yield pending  # a stream that ended without a final blank line: pass it on as is
    finally:
        on_end(error)
        await upstream.aclose()
