"""The API side of the engine: submit token-id requests, get text deltas back, abort, watch health.

One OutputProcessor (detokenization and stop strings) serves every request; it runs once per
engine step on the whole batch of outputs. Its deltas are handed to the GenerationStream of
each API call, which its handler drains in batches: a slow client costs nothing per token to
the others, and one that fell behind gets several tokens in one wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from deepinfer.engine.ipc.protocol import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineMessage,
    EngineOutputs,
    ResetPrefixCache,
    WireRequest,
)
from deepinfer.engine.ipc.transport import EngineTransport
from deepinfer.engine.outputs import KVHandoff
from deepinfer.engine.stats import EngineStats
from deepinfer.frontend.output_processor import OutputProcessor, SequenceDelta
from deepinfer.sequence import EngineRequest
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine is gone: requests in flight fail with this, new ones are refused."""


@dataclass(slots=True)
class RequestRecord:
    """One engine request's life, for metrics."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    unfinished: int  # sequences still generating
    first_token_time: float | None = None
    finish_time: float | None = None
    output_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens.values())


RequestObserver = Callable[[RequestRecord, str], None]  # (record, outcome)


class GenerationStream:
    """The deltas of one API call's engine requests (several for a multi-prompt completion)."""

    def __init__(self, client: EngineClient, records: list[RequestRecord]) -> None:
        self._client = client
        self.records = {r.request_id: r for r in records}
        self.open = {r.request_id for r in records}  # requests with a sequence still generating
        self.error: str | None = None
        self._pending: list[SequenceDelta] = []
        self._wakeup = asyncio.Event()

    def deliver(self, delta: SequenceDelta, now: float) -> bool:
        """Queue a delta for the handler; True when it completes its request."""
        record = self.records[delta.request_id]
        record.output_tokens[delta.index] = delta.num_output_tokens
        self._pending.append(delta)
        self._wakeup.set()
        if delta.finish_reason is None:
            return False
        record.finish_reasons.append(delta.finish_reason)
        record.unfinished -= 1
        if record.unfinished > 0:
            return False
        record.finish_time = now
        self.open.discard(delta.request_id)
        return True

    def fail(self, message: str) -> None:
        self.error = message
        self.open.clear()
        self._wakeup.set()

    async def batches(self) -> AsyncIterator[list[SequenceDelta]]:
        """Deltas in arrival order, as many as have arrived per wake-up; raises EngineDeadError
        (after the deltas that arrived before) when the engine dies."""
        while True:
            if self._pending:
                batch, self._pending = self._pending, []
                yield batch
                continue
            if self.error is not None:
                raise EngineDeadError(self.error)
            if not self.open:
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    def abort(self) -> None:
        """Abort every request of this call still generating (the client is gone); idempotent."""
        for request_id in list(self.open):
            self._client.abort(request_id, self.records[request_id])
        self.open.clear()


class EngineClient:
    def __init__(
        self,
        transport: EngineTransport,
        tokenizer: Tokenizer,
        *,
        on_request_done: RequestObserver | None = None,
    ) -> None:
        self.transport = transport
        self.info: EngineInfo = transport.info
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.num_waiting = 0  # requests sent whose first token has not come back yet
        self._streams: dict[str, GenerationStream] = {}
        self._on_request_done = on_request_done
        self._reset_waiters: list[asyncio.Future[bool]] = []
        self._handoff_waiters: dict[str, asyncio.Future[KVHandoff]] = {}
        transport.listen(self._on_message, self._on_death)

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self, requests: list[tuple[EngineRequest, str | None]], arrival: float | None = None
    ) -> GenerationStream:
        """Send validated requests (with their prompt text, if any) to the engine. `arrival`
        (time.monotonic() when the HTTP request came in) is where latencies start."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        start = time.monotonic() if arrival is None else arrival
        records = [
            RequestRecord(r.request_id, start, len(r.prompt_token_ids), unfinished=r.params.n)
            for r, _ in requests
        ]
        stream = GenerationStream(self, records)
        for request, prompt_text in requests:
            self.processor.add_request(
                request.request_id, prompt_text, request.prompt_token_ids, request.params
            )
            self._streams[request.request_id] = stream
            self.num_waiting += 1
            self.transport.send(AddRequest(WireRequest.of(request)))
        return stream

    def abort(self, request_id: str, record: RequestRecord) -> None:
        self.transport.send(AbortRequest(request_id))
        self._forget(request_id, record, "abort")

    def _forget(self, request_id: str, record: RequestRecord, outcome: str) -> None:
        self.processor.drop(request_id)
        self._streams.pop(request_id, None)
        if record.first_token_time is None:
            self.num_waiting -= 1
        if record.finish_time is None:
            record.finish_time = time.monotonic()
        if self._on_request_done is not None:
            self._on_request_done(record, outcome)

    def expect_handoff(self, transfer_id: str) -> asyncio.Future[KVHandoff]:
        """The KVHandoff a prefill engine sends once `transfer_id`'s KV is ready (register it
        before submitting the request). Fails with EngineDeadError if the engine dies first."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        waiter: asyncio.Future[KVHandoff] = asyncio.get_running_loop().create_future()
        self._handoff_waiters[transfer_id] = waiter
        waiter.add_done_callback(lambda _: self._handoff_waiters.pop(transfer_id, None))
        return waiter

    async def reset_prefix_cache(self) -> bool:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(waiter)
        self.transport.send(ResetPrefixCache())
        return await waiter

    # -- engine messages -----------------------------------------------------------------------

    def _on_message(self, message: EngineMessage) -> None:
        try:
            self._handle(message)
        except Exception:
            # Requests must never hang on a bug here: fail them all, loudly.
            log.exception("could not process the engine's outputs")
            self._on_death("internal error while processing the engine's outputs")

    def _handle(self, message: EngineMessage) -> None:
        if isinstance(message, EngineOutputs):
            self.stats = message.stats
            if message.outputs:
                self._dispatch(message)
            for handoff in message.handoffs:
                handoff_waiter = self._handoff_waiters.get(handoff.transfer_id)
                if handoff_waiter is not None and not handoff_waiter.done():
                    handoff_waiter.set_result(handoff)
            if message.prefix_cache_reset is not None and self._reset_waiters:
                waiter = self._reset_waiters.pop(0)
                if not waiter.done():
                    waiter.set_result(message.prefix_cache_reset)
        elif isinstance(message, EngineFailed):
            self._on_death(message.message)

    def _dispatch(self, message: EngineOutputs) -> None:
        deltas, stopped = self.processor.process(message.outputs)
        for request_id, index in stopped:
            # Ended on a stop string, which only this side can see: free it in the engine.
            self.transport.send(AbortRequest(request_id, index))
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            record = stream.records[delta.request_id]
            if record.first_token_time is None:
                record.first_token_time = now
                self.num_waiting -= 1
            if stream.deliver(delta, now):
                self.processor.drop(delta.request_id)
                del self._streams[delta.request_id]
                if self._on_request_done is not None:
                    self._on_request_done(record, _outcome(record.finish_reasons))

    def _on_death(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        log.error("engine failure: %s", reason)
        self.dead_reason = reason
        self._end_all(reason, "error", abort_in_engine=False)
        for waiter in self._reset_waiters:
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self._reset_waiters.clear()
        for handoff_waiter in list(self._handoff_waiters.values()):
            if not handoff_waiter.done():
                handoff_waiter.set_exception(EngineDeadError(reason))

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._streams)

    def abort_all(self, reason: str) -> None:
        """End every request in flight now: the engine frees them, and each stream ends with
        `reason` as its error (after whatever it already delivered)."""
        self._end_all(reason, "abort", abort_in_engine=True)

    def _end_all(self, reason: str, outcome: str, *, abort_in_engine: bool) -> None:
        streams = list({id(s): s for s in self._streams.values()}.values())
        for request_id, stream in list(self._streams.items()):
            if abort_in_engine:
                self.transport.send(AbortRequest(request_id))
            self._forget(request_id, stream.records[request_id], outcome)
        for stream in streams:
            stream.fail(reason)

    async def close(self, flush_timeout_s: float = 30.0) -> None:
        await self.transport.close(flush_timeout_s)


def _outcome(reasons: list[str]) -> str:
    """A request's outcome from its choices' finish reasons (the worst one wins)."""
    for worst in ("error", "abort", "length"):
        if worst in reasons:
            return worst
    return "stop"
