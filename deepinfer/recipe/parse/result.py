"""Folding one choice's events into its final message (for non-streamed responses and tests)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from deepinfer.recipe.events import (
    Event,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from deepinfer.recipe.ir import Message, Reasoning, TextPart, ToolCall


@dataclass(slots=True)
class ParsedCompletion:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None

    def to_message(self) -> Message:
        return Message(
            role="assistant",
            content=[TextPart(self.content)] if self.content else [],
            reasoning=[Reasoning(self.reasoning)] if self.reasoning else [],
            tool_calls=list(self.tool_calls),
        )


class CompletionBuilder:
    """Accumulates events; a tool call counts only once its ToolCallEnd arrived."""

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._open: dict[int, tuple[ToolCallStart, list[str]]] = {}
        self._calls: list[ToolCall] = []
        self._finish: Finish | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, TextDelta):
            self._content.append(event.text)
        elif isinstance(event, ToolCallStart):
            self._open[event.index] = (event, [])
        elif isinstance(event, ToolCallArgsDelta):
            self._open[event.index][1].append(event.delta)
        elif isinstance(event, ToolCallEnd):
            start, parts = self._open.pop(event.index)
            if "".join(parts) != event.arguments:
                raise ValueError(f"tool call {event.index}: the deltas do not add up to the final arguments")
            self._calls.append(ToolCall(id=start.id, name=start.name, arguments=event.arguments))
        elif isinstance(event, Finish):
            self._finish = event

    def extend(self, events: Iterable[Event]) -> None:
        for event in events:
            self.add(event)

    def result(self) -> ParsedCompletion:
        return ParsedCompletion(
            reasoning="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=list(self._calls),
            finish_reason=self._finish.reason if self._finish else None,
            stop_sequence=self._finish.stop_sequence if self._finish else None,
        )
