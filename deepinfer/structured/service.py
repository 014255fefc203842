"""Grammar compilation off the engine step: a cache, worker threads, and a timeout per compile.

The engine calls `submit(spec)` when a request arrives and gets a `GrammarHandle` at once. A
request whose handle is not `done()` waits while the rest of the batch keeps running; one whose
handle failed is finished with the handle's error (the server answers it with a 400).

Compiled grammars are cached by (canonical spec, tokenizer fingerprint, backend options). Errors
are cached too: a schema that timed out fails fast the next time instead of occupying a thread
again. Identical specs submitted while one is compiling share that compilation.

A timeout cannot stop a compile running inside native code. The compile is abandoned: its handle
fails, its worker slot is handed to the next job, and its thread finishes in the background (the
backend's own size limits bound how long) with the result discarded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.structured.errors import GrammarError
from deepinfer.structured.spec import GrammarSpec


class GrammarHandle:
    """The future result of one compilation; never blocks unless `wait` is called."""

    __slots__ = ("_callbacks", "_error", "_event", "_grammar", "_lock", "spec")

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._grammar: CompiledGrammar | None = None
        self._error: GrammarError | None = None
        self._callbacks: list[Callable[[GrammarHandle], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    @property
    def error(self) -> GrammarError | None:
        """The failure, once done; None while compiling or after success."""
        return self._error

    def result(self) -> CompiledGrammar:
        """The compiled grammar; raises GrammarCompileError (a 400) on failure."""
        if not self._event.is_set():
            raise RuntimeError("the grammar is still compiling; check done() first")
        if self._error is not None:
            raise self._error.to_exception()
        assert self._grammar is not None
        return self._grammar

    def new_matcher(self) -> GrammarMatcher:
        return self.result().new_matcher()

    def add_done_callback(self, callback: Callable[[GrammarHandle], None]) -> None:
        """Call `callback(handle)` once done: now if it already is, else on the thread that
        resolves it (a compile worker or the supervisor, under the service's lock), so the
        callback must be quick and must not block, e.g. `loop.call_soon_threadsafe`."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _resolve(self, grammar: CompiledGrammar | None, error: GrammarError | None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._grammar, self._error = grammar, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True


@dataclass(slots=True)
class CompileStats:
    cache_hits: int = 0
    compiles_started: int = 0
    compiled: int = 0
    failed: int = 0
    timed_out: int = 0


@dataclass(slots=True, eq=False)
class _Job:
    key: tuple[str, str, str]
    handle: GrammarHandle
    deadline: float = 0.0
    abandoned: bool = False


class GrammarCompileService:
    def __init__(
        self,
        backend: GrammarBackend,
        *,
        timeout_s: float = 10.0,
        max_workers: int = 2,
        cache_size: int = 512,
    ) -> None:
        if timeout_s <= 0 or max_workers < 1 or cache_size < 1:
            raise ValueError("timeout_s must be > 0, max_workers >= 1, cache_size >= 1")
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._cond = threading.Condition()
        self._cache: OrderedDict[tuple[str, str, str], GrammarHandle] = OrderedDict()
        self._inflight: dict[tuple[str, str, str], _Job] = {}
        self._pending: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._closed = False
        self._abandoned_running = 0
        self._supervisor = threading.Thread(target=self._supervise, name="grammar-supervisor", daemon=True)
        self._supervisor.start()

    def submit(self, spec: GrammarSpec) -> GrammarHandle:
        """Start (or join, or reuse) the compilation of `spec`; returns immediately."""
        key = (
            spec.cache_key,
            self.backend.tokenizer_info.fingerprint,
            f"{self.backend.options_key}|{spec.param}",
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile service is closed")
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return cached
            job = self._inflight.get(key)
            if job is not None:
                self.stats.cache_hits += 1
                return job.handle
            job = _Job(key, GrammarHandle(spec))
            self._inflight[key] = job
            self._pending.append(job)
            self._cond.notify_all()
            return job.handle

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking convenience (offline use, tests): the grammar, or GrammarCompileError."""
        handle = self.submit(spec)
        handle.wait()
        return handle.result()

    @property
    def num_abandoned_running(self) -> int:
        """Timed-out compiles whose threads are still busy in the background."""
        with self._cond:
            return self._abandoned_running

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._pending:
                job = self._pending.popleft()
                self._inflight.pop(job.key, None)
                job.handle._resolve(
                    None, GrammarError("invalid", "the grammar compile service was shut down")
                )
            self._cond.notify_all()
        self._supervisor.join(timeout=5)

    # -- internals --------------------------------------------------------------------------

    def _supervise(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for job in [j for j in self._running if j.deadline <= now]:
                    self._expire(job)
                while self._pending and len(self._running) < self.max_workers:
                    self._start(self._pending.popleft())
                deadlines = [j.deadline for j in self._running]
                self._cond.wait(timeout=max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)

    def _start(self, job: _Job) -> None:
        job.deadline = time.monotonic() + self.timeout_s
        self._running.add(job)
        self.stats.compiles_started += 1
        threading.Thread(target=self._work, args=(job,), name="grammar-compile", daemon=True).start()

    def _expire(self, job: _Job) -> None:
        self._running.discard(job)
        job.abandoned = True
        self._abandoned_running += 1
        self.stats.timed_out += 1
        spec = job.handle.spec
        error = GrammarError(
            "timeout",
            f"{spec.param}: compiling the constraint took longer than {self.timeout_s:g} s; "
            "the schema or grammar is too complex to enforce",
            param=spec.param,
        )
        self._finish(job, None, error)

    def _work(self, job: _Job) -> None:
        try:
            outcome = self.backend.compile(job.handle.spec)
        except Exception as e:  # a backend bug must fail one request, not kill the service
            outcome = GrammarError("invalid", f"{job.handle.spec.param}: grammar compilation failed: {e}")
        with self._cond:
            if job.abandoned:
                self._abandoned_running -= 1
                return
            self._running.discard(job)
            if isinstance(outcome, GrammarError):
                self.stats.failed += 1
                self._finish(job, None, outcome)
            else:
                self.stats.compiled += 1
                self._finish(job, outcome, None)
            self._cond.notify_all()

    def _finish(self, job: _Job, grammar: CompiledGrammar | None, error: GrammarError | None) -> None:
        self._inflight.pop(job.key, None)
        job.handle._resolve(grammar, error)
        self._cache[job.key] = job.handle
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
