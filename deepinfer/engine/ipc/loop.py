"""The engine's busy loop, and the entry point of the engine process.

While there is work the loop never blocks: it takes whatever new and abort messages have
arrived, runs one step, and sends that step's new tokens with the engine's stats as one
message. With nothing to do it blocks on its inbox (waking once a second to notice that the
API process is gone, so an orphaned engine never lingers; every 50 ms while its KV connector
holds blocks for another engine or waits on writes, so those are released on time). After
every step the KV events the step caused go out on the publisher, when there is one.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
from collections.abc import Callable
from typing import Protocol

import zmq

from deepinfer.config import EngineConfig
from deepinfer.engine.ipc.protocol import (
    AbortRequest,
    AddRequest,
    Codec,
    EngineFailed,
    EngineInfo,
    EngineInput,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    ResetPrefixCache,
    Shutdown,
)
from deepinfer.engine.outputs import SequenceOutput
from deepinfer.engine.parallel.start import start_engine
from deepinfer.engine.protocol import Engine
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.transport.kv_events import KVEventPublisher

log = logging.getLogger(__name__)

IDLE_WAKEUP_S = 1.0
DEFAULT_FLUSH_TIMEOUT_S = 30.0
CONNECTOR_WAKEUP_S = 0.05


class Inbox(Protocol):
    def drain(self) -> list[EngineInput]:
        """Every message that has arrived, without blocking."""
        ...

    def wait(self, timeout_s: float) -> list[EngineInput]:
        """Block until at least one message arrives (or the timeout passes); then drain."""
        ...


class QueueInbox:
    """The inbox of an engine running on a thread of the API process."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[EngineInput] = queue.SimpleQueue()

    def put(self, message: EngineInput) -> None:
        self.queue.put(message)

    def drain(self) -> list[EngineInput]:
        messages = []
        while True:
            try:
                messages.append(self.queue.get_nowait())
            except queue.Empty:
                return messages

    def wait(self, timeout_s: float) -> list[EngineInput]:
        try:
            first = self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self.drain()]


class ZmqInbox:
    """The inbox of the engine process: a PULL socket fed by the API process."""

    def __init__(self, socket: zmq.Socket, codec: Codec) -> None:
        self.socket = socket
        self.codec = codec

    def drain(self) -> list[EngineInput]:
        messages = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self.codec.decode_input(frame.buffer))

    def wait(self, timeout_s: float) -> list[EngineInput]:
        if not self.socket.poll(int(timeout_s * 1000)):
            return []
        return self.drain()


def engine_info(core: Engine, publisher: KVEventPublisher | None = None) -> EngineInfo:
    config = core.config
    pd = config.disaggregation
    # Chunks are what the store and host tiers keep and what a PD handoff moves (direct or
    # through the store): a prefill or decode engine without a store still cuts them.
    chunked = config.store.enabled or pd.role in ("prefill", "decode")
    return EngineInfo(
        model_name=core.loaded.name,
        max_model_len=core.max_model_len,
        vocab_size=core.loaded.config.vocab_size,
        eos_token_ids=list(core.loaded.config.eos_token_ids),
        num_blocks=core.num_blocks,
        block_size=core.config.cache.block_size,
        fingerprint=core.fingerprint,
        traffic_classes=core.config.store.traffic_classes,
        max_num_seqs=core.config.scheduler.max_num_seqs,
        max_num_batched_tokens=core.config.scheduler.max_num_batched_tokens,
        role=pd.role,
        kv_transfer=pd.kv_transfer,
        kv_transfer_failure=pd.kv_transfer_failure,
        kv_transfer_address=core.kv_transfer_address,
        kv_events_endpoint=publisher.endpoint if publisher is not None else None,
        kv_store=config.store.identity,
        kv_chunk_blocks=config.store.kv_chunk_blocks if chunked else 0,
        kv_transfer_layout=core.kv_transfer_layout,
        accepts_images=core.loaded.model.accepts_images,
    )


def build_publisher(config: EngineConfig) -> KVEventPublisher | None:
    pd = config.disaggregation
    if pd.kv_events_endpoint is None:
        return None
    return KVEventPublisher(
        pd.kv_events_endpoint, key=cluster_key_of(pd.cluster_key_file), token_ids=pd.kv_events_token_ids
    )


class EngineLoop:
    def __init__(
        self,
        core: Engine,
        inbox: Inbox,
        emit: Callable[[EngineMessage], None],
        alive: Callable[[], bool] | None = None,
        publisher: KVEventPublisher | None = None,
    ) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self.alive = alive
        self.publisher = publisher

    def run(self) -> float:
        """Serve until a Shutdown message (or the death of the API process); returns how long
        the core may take to flush on close."""
        core = self.core
        self._send([], None)  # the stats of an engine that has served nothing yet
        while True:
            if core.has_work():
                messages = self.inbox.drain()
            else:
                busy = core.connector_busy
                messages = self.inbox.wait(CONNECTOR_WAKEUP_S if busy else IDLE_WAKEUP_S)
                if not messages:
                    if self.alive is not None and not self.alive():
                        log.warning("the API process is gone; the engine stops")
                        return DEFAULT_FLUSH_TIMEOUT_S
                    if busy:
                        self._send(core.housekeeping(), None)
                    continue
            outputs: list[SequenceOutput] = []
            reset: bool | None = None
            for message in messages:
                if isinstance(message, AddRequest):
                    outputs.extend(self._add(message))
                elif isinstance(message, AbortRequest):
                    core.abort(message.request_id, message.index)
                elif isinstance(message, ResetPrefixCache):
                    reset = core.reset_prefix_cache()
                elif isinstance(message, Shutdown):
                    return message.flush_timeout_s
            if core.has_work():
                outputs.extend(core.step())
            # Stats go out even without new tokens: after aborts on an idle engine they are
            # the only news (freed blocks).
            self._send(outputs, reset)

    def _send(self, outputs: list[SequenceOutput], reset: bool | None) -> None:
        core = self.core
        self.emit(EngineOutputs(outputs, core.stats(), reset, core.take_handoffs()))
        if self.publisher is not None:
            self.publisher.publish(core.take_kv_events())

    def _add(self, message: AddRequest) -> list[SequenceOutput]:
        request = message.request.to_request()
        try:
            self.core.add_request(request)
        except Exception:
            # The API side validated the request; a failure here is a bug, and it must end
            # this request rather than the engine.
            log.exception("could not add request %s", request.request_id)
            return [
                SequenceOutput(
                    request.request_id, index, [], finish_reason="error", error="internal engine error"
                )
                for index in range(request.params.n)
            ]
        return []


def engine_process_main(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int, log_level: str
) -> None:
    """Entry point of the engine process (spawned by ProcessTransport)."""
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    codec = Codec()
    context = zmq.Context()
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)  # let a last EngineFailed leave before the process ends
    outbox.connect(output_address)
    inbox_socket = context.socket(zmq.PULL)
    inbox_socket.setsockopt(zmq.RCVHWM, 0)  # see ProcessTransport: never drop a request
    inbox_socket.connect(input_address)

    def emit(message: EngineMessage) -> None:
        outbox.send(codec.encode(message), copy=False)

    # Another rank's death is seen on a watchdog thread, which reports it on a socket of its own
    # and ends this process (the ranks it spawned die with it): clients get errors in seconds,
    # even while the engine idles or waits in a collective.
    alarm = context.socket(zmq.PUSH)
    alarm.setsockopt(zmq.LINGER, 2000)
    alarm.connect(output_address)

    def rank_died(reason: str) -> None:
        if not alarm.closed:  # closed: the engine is stopping anyway
            alarm.send(codec.encode(EngineFailed(f"the engine failed: {reason}")))
            alarm.close()  # lingers until the message is out
        os._exit(1)

    try:
        core = start_engine(config, on_rank_death=rank_died, log_level=log_level)
        publisher = build_publisher(config)
    except Exception as error:
        # The API side reports the message in one line; the traceback is for --log-level debug.
        log.debug("the engine failed to start", exc_info=True)
        emit(EngineFailed(f"the engine failed to start: {type(error).__name__}: {error}"))
        raise SystemExit(1) from error
    # From now on SIGTERM is the API process's to act on, as Ctrl-C is: a supervisor that signals
    # the whole group (systemd's default, `kill -- -PGID`) would otherwise end the engine at once
    # and lose the KV-store writes still queued, which the API's Shutdown flushes. (While loading
    # there is nothing to flush, and the API process stops a loading engine with SIGTERM.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit(EngineReady(engine_info(core, publisher)))
    loop = EngineLoop(
        core,
        ZmqInbox(inbox_socket, codec),
        emit,
        alive=lambda: os.getppid() == parent_pid,
        publisher=publisher,
    )
    flush_timeout_s = DEFAULT_FLUSH_TIMEOUT_S
    try:
        flush_timeout_s = loop.run()
    except Exception as error:
        log.exception("the engine loop failed")
        emit(EngineFailed(f"the engine failed: {type(error).__name__}: {error}"))
        raise SystemExit(1) from error
    finally:
        stats = core.stats()
        log.info(
            "engine stopping: %d of %d KV blocks in use, %d requests unfinished",
            stats.num_blocks - stats.num_free_blocks,
            stats.num_blocks,
            core.num_unfinished_requests,
        )
        core.close(flush_timeout_s)  # KV writes flushed; worker threads end with the engine
        if publisher is not None:
            publisher.close()
        inbox_socket.close(linger=0)
        alarm.close(linger=0)
        outbox.close()
        context.term()  # blocks until every socket of the context is closed
