"""Structured output in the engine core: compile grammars off the step, hand out matchers.

A constrained request is admitted only once its grammar has compiled (compilation runs on the
compile service's worker threads with a timeout; other requests keep running meanwhile). Each
sequence then owns a matcher: the runner fills its bitmask row before sampling and feeds it the
sampled token. Siblings forked for n > 1 get fresh matchers: forks happen before any token of
the request has been accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.sequence import Sequence
from deepinfer.structured import (
    GrammarCompileService,
    GrammarHandle,
    GrammarSpec,
    LLGuidanceBackend,
    LLGuidanceOptions,
    TokenizerInfo,
)
from deepinfer.structured.backend import GrammarMatcher
from deepinfer.structured.bitmask import allocate_bitmask

if TYPE_CHECKING:
    import torch
from deepinfer.tokenizer import Tokenizer

DEFAULT_COMPILE_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiting:
    seq: Sequence
    handle: GrammarHandle


@dataclass(slots=True)
class GrammarManager:
    tokenizer: Tokenizer
    model_vocab_size: int
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    mask_threads: int | None = None  # see LLGuidanceOptions; 0 when the model runs on the CPU
    _service: GrammarCompileService | None = None
    _backend: LLGuidanceBackend | None = None
    _waiting: list[_Waiting] = field(default_factory=list)
    _handles: dict[str, GrammarHandle] = field(default_factory=dict)  # request id -> its grammar

    @property
    def backend(self) -> LLGuidanceBackend:
        if self._backend is None:
            info = TokenizerInfo.from_tokenizer(self.tokenizer, self.model_vocab_size)
            self._backend = LLGuidanceBackend(info, LLGuidanceOptions(mask_threads=self.mask_threads))
        return self._backend

    @property
    def service(self) -> GrammarCompileService:
        if self._service is None:
            self._service = GrammarCompileService(self.backend, timeout_s=self.compile_timeout_s)
        return self._service

    def bitmask(self, matchers: list[GrammarMatcher]) -> tuple[torch.Tensor, list[int]]:
        """One packed allowed-token bitmask row per matcher (their current states), and the rows
        whose matcher failed (left all-allowed; their requests are to be ended)."""
        backend = self.backend
        bitmask = allocate_bitmask(len(matchers), backend.tokenizer_info.vocab_size)
        try:
            backend.fill_bitmasks([(matcher, row) for row, matcher in enumerate(matchers)], bitmask)
            return bitmask, []
        except Exception:
            log.exception("filling grammar masks failed; isolating the matcher at fault")
        failed = []
        for row, matcher in enumerate(matchers):  # one by one: only the faulty ones fail
            try:
                backend.fill_bitmasks([(matcher, row)], bitmask)
            except Exception:
                failed.append(row)
        return bitmask, failed

    def validate(self, spec: GrammarSpec) -> None:
        """Compile now (cached for the engine's later submit); raises an InvalidRequestError subclass
        naming the unsupported keyword, or reporting the compile timeout."""
        self.service.compile(spec)

    def attach(self, seq: Sequence, spec: GrammarSpec) -> None:
        """Start compiling; the sequence is not admitted until poll() sees the grammar ready."""
        handle = self.service.submit(spec)
        self._handles[seq.request_id] = handle
        seq.num_pending += 1
        self._waiting.append(_Waiting(seq, handle))

    def poll(self) -> list[tuple[Sequence, str]]:
        """Give matchers to sequences whose grammar compiled; return (sequence, error) for failures."""
        failed: list[tuple[Sequence, str]] = []
        still: list[_Waiting] = []
        for waiting in self._waiting:
            if not waiting.handle.done():
                still.append(waiting)
                continue
            seq = waiting.seq
            seq.num_pending -= 1
            if waiting.handle.error is not None:
                failed.append((seq, str(waiting.handle.error.to_exception())))
                self._handles.pop(seq.request_id, None)
            elif not seq.is_finished:
                seq.grammar = waiting.handle.new_matcher()
        self._waiting = still
        return failed

    def fork(self, child: Sequence) -> None:
        handle = self._handles.get(child.request_id)
        if handle is not None:
            child.grammar = handle.new_matcher()

    def release(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
