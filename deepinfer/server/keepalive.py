"""Ticks in a silent stream: a long prefill (a 20,000-token agent prompt on a CPU takes minutes)
sends nothing, and clients with a stream idle timer (Claude Code, proxies) give up on a silence
they cannot tell from a dead connection. The stream answers each tick with a keep-alive frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_ticks(items: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """`items` as they come, and None each time `interval_s` passes without one.

    The pending read is a task that outlives a tick: cancelling it would end `items` (an async
    generator cannot resume after an exception thrown into it). Closing this iterator cancels
    the read."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            read, pending = pending, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
