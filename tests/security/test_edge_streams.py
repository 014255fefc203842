"""A stream whose client reads nothing is cut (issue 30, finding 11): once the socket's buffers
are full, uvicorn's send waits; after SEND_STALL_S without progress the generation is aborted,
so its deltas stop queueing. (A socket test would need a minute of a full buffer: the send is
stood in for by one that never completes.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from deepinfer.server import http_io
from deepinfer.server.http_io import EventStreamResponse


async def _frames(produced: list[int]) -> AsyncIterator[str]:
    for i in range(1_000_000):
        produced.append(i)
        yield f"data: {i}\n\n"


def test_a_client_that_never_reads_is_cut_and_its_generation_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_io, "SEND_STALL_S", 0.2)
    produced: list[int] = []
    aborted: list[bool] = []
    sent: list[dict] = []

    async def stuck_send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's window is full, forever

    async def never_disconnects() -> dict:
        await asyncio.Event().wait()
        return {}

    async def run() -> None:
        response = EventStreamResponse(_frames(produced), on_disconnect=lambda: aborted.append(True))
        await asyncio.wait_for(response({"type": "http"}, never_disconnects, stuck_send), 30)

    asyncio.run(run())
    assert aborted == [True]
    # One frame went into the stuck send; the generator was not drained behind it.
    assert len(produced) == 1 and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
