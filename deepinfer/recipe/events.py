"""Canonical output events: what a streaming parser emits and every API encoder consumes.

One event stream per choice (sequence). Encoders own all API bookkeeping (indexes, block
open/close, sequence numbers); parsers only say what the model produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int  # 0-based within this choice
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    index: int
    delta: str  # raw substring; the concatenation equals the final arguments exactly


@dataclass(slots=True)
class ToolCallEnd:
    index: int
    arguments: str  # the complete raw JSON arguments


@dataclass(slots=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int] | None = None


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Logprobs:
    """Logprobs of the sampled tokens since the previous Logprobs event."""

    tokens: list[TokenLogprob]


@dataclass(slots=True)
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None  # the stop string that matched, when one did
    message: str | None = None  # error text when reason == "error"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


Event = (
    ReasoningDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Logprobs | Finish | Usage
)
