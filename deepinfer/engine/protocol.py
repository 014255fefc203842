"""What the callers of an engine use of it (the engine loop and engine_info, LLMEngine, the offline
API, benchmarks): one EngineCore in this process, or DataParallelEngine in front of several ranks'
cores. Nothing else of either is read through this name."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.outputs import KVHandoff, SequenceOutput
from deepinfer.engine.stats import EngineStats
from deepinfer.model.loader.load import LoadedModel
from deepinfer.sequence import EngineRequest
from deepinfer.speculative.stats import SpecDecodeStats
from deepinfer.structured import GrammarSpec
from deepinfer.transport.kv_event_log import KVEvent


class Engine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def loaded(self) -> LoadedModel:
        """The (rank 0) model, its config and tokenizer."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def fingerprint(self) -> str:
        """Weights and cache layout: the prefix-cache namespace of every request."""
        ...

    @property
    def num_blocks(self) -> int:
        """KV blocks of one rank (what engine_info announces)."""
        ...

    @property
    def num_unfinished_requests(self) -> int: ...

    @property
    def kv_transfer_address(self) -> str | None: ...

    @property
    def kv_transfer_layout(self) -> str | None: ...

    @property
    def connector_busy(self) -> bool:
        """Whether the KV connector needs polling while no sequence runs."""
        ...

    def validate_grammar(self, spec: GrammarSpec) -> None:
        """Compile a structured-output constraint before its request enters; raises if unsupported."""
        ...

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str, index: int | None = None) -> list[SequenceOutput]:
        """Abort a request (or one of its sequences): the outputs of what was aborted at once."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> list[SequenceOutput]: ...

    def housekeeping(self) -> list[SequenceOutput]:
        """What an idle engine still owes its KV connector."""
        ...

    def reset_prefix_cache(self) -> bool: ...

    def take_handoffs(self) -> list[KVHandoff]: ...

    def take_kv_events(self) -> list[KVEvent]: ...

    def stats(self) -> EngineStats: ...

    def spec_stats(self) -> SpecDecodeStats | None: ...

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] of every position of a prompt."""
        ...

    def close(self, timeout_s: float = 30.0) -> None: ...
