"""How the API process reaches the engine core: a separate process over ZeroMQ, or a thread.

Both transports give the same three things to the EngineClient: `start()` (load the model,
return EngineInfo), `send(message)`, and two callbacks run on the asyncio loop: every message
from the engine, and the engine's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import zmq
import zmq.asyncio

from deepinfer.config import EngineConfig
from deepinfer.engine.ipc.protocol import (
    Codec,
    EngineFailed,
    EngineInfo,
    EngineInput,
    EngineMessage,
    EngineReady,
    Shutdown,
)

log = logging.getLogger(__name__)

OnMessage = Callable[[EngineMessage], None]
OnDeath = Callable[[str], None]

SHUTDOWN_GRACE_S = 10.0


class EngineStartError(RuntimeError):
    """The engine could not load (bad model path, not enough memory, ...)."""


class EngineTransport(ABC):
    info: EngineInfo

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Start the engine and wait until its model is loaded."""

    @abstractmethod
    def listen(self, on_message: OnMessage, on_death: OnDeath) -> None:
        """Deliver engine messages from now on (on the running asyncio loop)."""

    @abstractmethod
    def send(self, message: EngineInput) -> None: ...

    @abstractmethod
    async def close(self, flush_timeout_s: float = 30.0) -> None:
        """Stop the engine (gracefully: it flushes queued KV-store writes for at most
        `flush_timeout_s`; then by force) and release everything."""

    @property
    @abstractmethod
    def engine_pid(self) -> int | None: ...


def _engine_process(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int, log_level: str
) -> None:
    """The engine process's target. The engine (and torch) is imported here, in the child: the
    API process, which only pickles this function's name, never loads torch (2-4 s of every
    server start)."""
    from deepinfer.engine.ipc.loop import engine_process_main

    engine_process_main(config, input_address, output_address, parent_pid, log_level)


class ProcessTransport(EngineTransport):
    """The engine core in its own process; PUSH/PULL sockets over ipc:// in a private temp dir."""

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        self.config = config
        self.log_level = log_level
        self.codec = Codec()
        self._dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a send must never be dropped while the engine is busy in a long
        # step. Admission control (max waiting requests) is what bounds this queue.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(f"ipc://{self._dir}/input")
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(f"ipc://{self._dir}/output")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._on_message: OnMessage | None = None
        self._on_death: OnDeath | None = None
        self._closing = False
        self._ready = False

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> EngineInfo:
        # spawn: the child must not inherit this process's event loop, threads or sockets.
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(
            target=_engine_process,
            args=(
                self.config,
                f"ipc://{self._dir}/input",
                f"ipc://{self._dir}/output",
                os.getpid(),
                self.log_level,
            ),
            name="deepinfer-engine",
        )
        self._process.start()
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self._process.sentinel, lambda: died.done() or died.set_result(None))
        first = asyncio.ensure_future(self._output.recv(copy=False))
        try:
            await asyncio.wait({first, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(self._process.sentinel)
        if not first.done():
            first.cancel()
            self._process.join(1.0)
            raise EngineStartError(
                f"the engine process exited with code {self._process.exitcode} while loading"
            )
        message = self.codec.decode_message(first.result().buffer)
        if isinstance(message, EngineFailed):
            self._process.join(5.0)
            raise EngineStartError(message.message)
        assert isinstance(message, EngineReady)
        self.info = message.info
        self._ready = True
        return self.info

    def listen(self, on_message: OnMessage, on_death: OnDeath) -> None:
        assert self._process is not None
        self._on_message, self._on_death = on_message, on_death
        self._reader = asyncio.ensure_future(self._read())
        # The process sentinel becomes readable when the process ends: no polling needed.
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._sentinel_fired)

    async def _read(self) -> None:
        assert self._on_message is not None
        decode = self.codec.decode_message
        while True:
            frame = await self._output.recv(copy=False)
            self._on_message(decode(frame.buffer))

    def _sentinel_fired(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join(0)
        if not self._closing and self._on_death is not None:
            self._on_death(
                f"the engine process (pid {self._process.pid}) exited with code {self._process.exitcode}"
            )

    def send(self, message: EngineInput) -> None:
        # The engine drains its socket every step; NOBLOCK keeps a dead engine from ever
        # stalling the event loop (the message is then simply lost, and the request fails).
        with contextlib.suppress(zmq.Again):
            self._input.send(self.codec.encode(message), zmq.NOBLOCK, copy=False)

    async def close(self, flush_timeout_s: float = 30.0) -> None:
        self._closing = True
        process = self._process
        if process is not None and process.exitcode is not None and process.exitcode < 0:
            log.warning(
                "the engine process was killed by signal %d before the server stopped it: queued "
                "KV-store writes, if any, were lost",
                -process.exitcode,
            )
        if process is not None and process.exitcode is None:
            grace = flush_timeout_s + SHUTDOWN_GRACE_S
            if self._ready:
                self.send(Shutdown(flush_timeout_s))
                await asyncio.to_thread(process.join, grace)
            # Still loading (it reads no messages yet) or stuck: SIGTERM, then SIGKILL.
            if process.exitcode is None:
                if self._ready:
                    log.warning("the engine did not stop in %.0f s; terminating it", grace)
                process.terminate()
                await asyncio.to_thread(process.join, 5.0)
            if process.exitcode is None:
                process.kill()
                await asyncio.to_thread(process.join)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        with contextlib.suppress(RuntimeError, ValueError):
            if process is not None:
                asyncio.get_running_loop().remove_reader(process.sentinel)
        self._input.close()
        self._output.close()
        self._sync_context.term()
        self._async_context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class ThreadTransport(EngineTransport):
    """The engine core on a thread of the API process: for tests and embedding."""

    def __init__(self, config: EngineConfig) -> None:
        from deepinfer.engine.ipc.loop import QueueInbox

        self.config = config
        self._inbox = QueueInbox()
        self._thread: threading.Thread | None = None
        self._on_message: OnMessage | None = None
        self._on_death: OnDeath | None = None
        self._backlog: list[EngineMessage] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine_pid(self) -> int | None:
        return os.getpid()

    async def start(self) -> EngineInfo:
        from deepinfer.engine.ipc.loop import (
            DEFAULT_FLUSH_TIMEOUT_S,
            EngineLoop,
            build_publisher,
            engine_info,
        )
        from deepinfer.engine.parallel.start import start_engine

        loop = self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[EngineInfo] = loop.create_future()

        def run() -> None:
            try:
                core = start_engine(self.config)
                publisher = build_publisher(self.config)
            except Exception as error:
                loop.call_soon_threadsafe(
                    ready.set_exception, EngineStartError(f"{type(error).__name__}: {error}")
                )
                return
            loop.call_soon_threadsafe(ready.set_result, engine_info(core, publisher))
            flush_timeout_s = DEFAULT_FLUSH_TIMEOUT_S
            try:
                flush_timeout_s = EngineLoop(core, self._inbox, self._emit, publisher=publisher).run()
            except Exception as error:
                log.exception("the engine loop failed")
                self._emit(EngineFailed(f"the engine failed: {type(error).__name__}: {error}"))
                loop.call_soon_threadsafe(self._died, f"the engine thread failed: {error}")
            finally:
                core.close(flush_timeout_s)
                if publisher is not None:
                    publisher.close()

        self._thread = threading.Thread(target=run, name="deepinfer-engine", daemon=True)
        self._thread.start()
        self.info = await ready
        return self.info

    def _emit(self, message: EngineMessage) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: EngineMessage) -> None:
        if self._on_message is None:
            self._backlog.append(message)
        else:
            self._on_message(message)

    def _died(self, reason: str) -> None:
        if self._on_death is not None:
            self._on_death(reason)

    def listen(self, on_message: OnMessage, on_death: OnDeath) -> None:
        self._on_message, self._on_death = on_message, on_death
        backlog, self._backlog = self._backlog, []
        for message in backlog:
            on_message(message)

    def send(self, message: EngineInput) -> None:
        self._inbox.put(message)

    async def close(self, flush_timeout_s: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(Shutdown(flush_timeout_s))
            await asyncio.to_thread(self._thread.join, flush_timeout_s + SHUTDOWN_GRACE_S)
