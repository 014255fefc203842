"""Background responses: run to completion without the client, recorded event by event.

A run consumes its engine stream on a task of its own and writes every batch of stream events
to the store (with the response object when its status changes), so that any replica can
answer `GET /v1/responses/{id}` and resume the stream after any sequence number. A cancel on
this replica stops the run at once; one on another replica marks the record cancelled, and the
run sees it at its next write. A stop of the server ends the runs still going as failed,
after the graceful drain gave them its deadline to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.frontend.client import EngineDeadError, GenerationStream
from deepinfer.recipe.api import ResponsesEncoder
from deepinfer.recipe.events import Event
from deepinfer.response_store import ResponseStore
from deepinfer.server.generation import ChoiceParsers

log = logging.getLogger(__name__)

# How often a stream that follows a run of another replica looks for new events.
POLL_INTERVAL_S = 0.25

Key = tuple[str, str]  # (tenant, response id)

# Runs a store method off the event loop, mapping an unreachable store to the API's error.
StoreCall = Callable[..., Awaitable[Any]]


@dataclass(slots=True)
class _Run:
    stream: GenerationStream
    choices: ChoiceParsers
    encoder: ResponsesEncoder
    consume: asyncio.Task[None] | None = None
    finished: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) per write
    last_write: asyncio.Future[str | None] | None = None
    cancelled: bool = False  # stop as `cancelled`
    stop_reason: str | None = None  # stop as `failed` with this message


class BackgroundRuns:
    def __init__(self, store: ResponseStore | None, call: StoreCall) -> None:
        self._maybe_store = store
        self._call = call
        self._runs: dict[Key, _Run] = {}

    @property
    def _store(self) -> ResponseStore:
        assert self._maybe_store is not None, "background responses need a store"
        return self._maybe_store

    def start(
        self,
        tenant: str,
        response_id: str,
        stream: GenerationStream,
        choices: ChoiceParsers,
        encoder: ResponsesEncoder,
    ) -> None:
        """Run a response whose record (status queued, opening events) is already stored."""
        key = (tenant, response_id)
        run = _Run(stream, choices, encoder)
        self._runs[key] = run
        run.consume = asyncio.ensure_future(self._consume(key, run))
        run.finished = asyncio.ensure_future(self._run(key, run))

    async def _run(self, key: Key, run: _Run) -> None:
        assert run.consume is not None
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await run.consume
            if run.last_write is not None:  # a cancel interrupts the wait, not the write: let it land
                with contextlib.suppress(Exception):
                    await run.last_write
            if run.cancelled:
                frames = run.encoder.cancel()
            else:
                frames = self._events(run, run.choices.fail(run.stop_reason)) if run.stop_reason else []
                frames += run.encoder.close()
            await self._write(key, run, frames, run.encoder.result, done=True)
        except Exception:
            log.exception("background response %s could not be recorded", key[1])
        finally:
            run.stream.abort()
            self._runs.pop(key, None)
            run.changed.set()

    async def _consume(self, key: Key, run: _Run) -> None:
        started = False
        try:
            async for batch in run.stream.batches():
                frames: list[str] = []
                response: dict[str, Any] | None = None
                if not started:
                    started = True
                    frames.extend(run.encoder.running())
                    response = run.encoder.snapshot("in_progress")
                for delta in batch:
                    frames.extend(self._events(run, run.choices.events(delta)))
                status = await self._write(key, run, frames, response)
                if status in (None, "cancelled"):  # deleted, or cancelled on another replica
                    run.cancelled = True
                    return
        except EngineDeadError as error:
            run.stop_reason = str(error)
        finally:
            run.stream.abort()

    @staticmethod
    def _events(run: _Run, events: list[tuple[int, Event]]) -> list[str]:
        frames: list[str] = []
        for _, event in events:
            frames.extend(run.encoder.feed(event))
        return frames

    async def _write(
        self, key: Key, run: _Run, frames: list[str], response: dict[str, Any] | None, *, done: bool = False
    ) -> str | None:
        if not frames and response is None and not done:
            return "in_progress"
        # Writes land in order (their events' sequence numbers are their positions in the store),
        # so a cancel never abandons one half-way: the final write waits for it.
        write = asyncio.ensure_future(self._call(self._store.advance, *key, frames, response, done=done))
        run.last_write = write
        status = await asyncio.shield(write)
        changed, run.changed = run.changed, asyncio.Event()
        changed.set()
        return status

    # -- control -------------------------------------------------------------------------------

    def is_local(self, tenant: str, response_id: str) -> bool:
        return (tenant, response_id) in self._runs

    async def stop_local(self, tenant: str, response_id: str) -> None:
        """Stop this replica's run of a response the store already marks cancelled, and wait
        until its last events and output are recorded."""
        run = self._runs.get((tenant, response_id))
        if run is None or run.consume is None or run.finished is None:
            return
        run.cancelled = True
        run.consume.cancel()
        await asyncio.shield(run.finished)

    async def follow(self, tenant: str, response_id: str, after: int) -> AsyncIterator[str]:
        """The run's stream events after sequence number `after`, then live ones until it is done
        (or its record is deleted)."""
        while True:
            run = self._runs.get((tenant, response_id))
            changed = run.changed if run is not None else None
            page = await self._call(self._store.events_after, tenant, response_id, after)
            if page is None:
                return
            if page.frames:
                after += len(page.frames)
                yield "".join(page.frames)
                continue
            if page.done:
                return
            if changed is None:  # a run of another replica (or of a server that stopped)
                await asyncio.sleep(POLL_INTERVAL_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), POLL_INTERVAL_S * 4)

    async def close(self, reason: str, timeout_s: float) -> None:
        """End every run still going (as failed, with `reason`) and wait for their records."""
        runs = list(self._runs.values())
        for run in runs:
            if run.consume is not None and not run.consume.done():
                run.stop_reason = reason
                run.consume.cancel()
        finished = [run.finished for run in runs if run.finished is not None]
        if finished:
            _, late = await asyncio.wait(finished, timeout=timeout_s)
            if late:
                log.warning("%d background responses were not recorded before the stop", len(late))
