"""Messages output: canonical events -> the Anthropic `message` and its stream events."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer.recipe.api._output import (
    FAILED,
    GenerationError,
    ToolCallTrack,
    failure_message,
    thinking_signature,
)
from deepinfer.recipe.api.error_bodies import anthropic_error_body
from deepinfer.recipe.api.sse import sse_frame
from deepinfer.recipe.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)


@dataclass(slots=True)
class _Block:
    kind: Literal["thinking", "text", "tool_use"]
    index: int
    text: list[str] = field(default_factory=list)
    call: ToolCallTrack | None = None

    def to_json(self) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": thinking_signature(text)}
        if self.kind == "text":
            return {"type": "text", "text": text}
        assert self.call is not None
        return {
            "type": "tool_use",
            "id": self.call.id,
            "name": self.call.name,
            "input": _tool_input(self.call),
        }


def _tool_input(call: ToolCallTrack) -> dict[str, Any]:
    """The parsed arguments; text that is not a JSON object (a malformed call) becomes {}."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesEncoder:
    """Turns one choice's events into Anthropic stream events (and the final `message`).

    Blocks are strictly sequential: each is stopped before the next starts; a text block opens
    only with non-empty text. `close()` emits `message_delta` (stop reason, cumulative usage) and
    `message_stop`, or an `error` event when generation failed.
    """

    def __init__(
        self,
        *,
        message_id: str,
        model: str,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        stream: bool = True,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens
        self._stream = stream
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}
        self._frames: list[str] = []
        self._finish: Finish | None = None
        self._usage: Usage | None = None
        self._started = False
        self._closed = False

    # -- frames

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._stream:
            self._frames.append(sse_frame({"type": kind, **fields}, event=kind))

    def _take(self) -> list[str]:
        frames, self._frames = self._frames, []
        return frames

    def _usage_json(self) -> dict[str, Any]:
        usage = self._usage
        prompt = usage.prompt_tokens if usage else self._prompt_tokens
        cached = usage.cached_tokens if usage else self._cached_tokens
        return {
            "input_tokens": prompt - cached,  # Anthropic counts cache reads apart from input
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": usage.completion_tokens if usage else 0,
        }

    # -- blocks

    def _start_block(
        self, kind: Literal["thinking", "text", "tool_use"], call: ToolCallTrack | None = None
    ) -> _Block:
        self._stop_open()
        block = _Block(kind=kind, index=len(self._blocks), call=call)
        self._blocks.append(block)
        self._open = block
        if kind == "thinking":
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            start = {"type": "text", "text": ""}
        else:
            assert call is not None
            start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        self._emit("content_block_start", index=block.index, content_block=start)
        return block

    def _stop_open(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if block.kind == "thinking":
            signature = thinking_signature("".join(block.text))
            self._emit(
                "content_block_delta",
                index=block.index,
                delta={"type": "signature_delta", "signature": signature},
            )
        self._emit("content_block_stop", index=block.index)

    def _delta(self, kind: Literal["thinking", "text"], text: str) -> None:
        block = self._open if self._open is not None and self._open.kind == kind else self._start_block(kind)
        block.text.append(text)
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        self._emit("content_block_delta", index=block.index, delta=delta)

    def _call_delta(self, index: int, delta: str, final: str | None) -> None:
        block = self._calls[index]
        if block is not self._open or block.call is None:
            return  # a later block already closed this call; its text can no longer be streamed
        sent = block.call.append(delta) if final is None else block.call.finish(final)
        if sent:
            self._emit(
                "content_block_delta",
                index=block.index,
                delta={"type": "input_json_delta", "partial_json": sent},
            )
        if final is not None:
            self._stop_open()

    # -- public

    def start(self) -> list[str]:
        self._ensure_started()
        return self._take()

    def _ensure_started(self) -> None:
        if self._started:
            return
        self._started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage_json(),
        }
        self._emit("message_start", message=message)
        self._emit("ping")

    def ping(self) -> list[str]:
        """A keep-alive frame the server may send while the engine is busy."""
        self._emit("ping")
        return self._take()

    def feed(self, event: Event) -> list[str]:
        self._ensure_started()
        if self._finish is not None and not isinstance(event, Usage):
            return self._take()
        if isinstance(event, ReasoningDelta) and event.text:
            self._delta("thinking", event.text)
        elif isinstance(event, TextDelta) and event.text:
            self._delta("text", event.text)
        elif isinstance(event, ToolCallStart):
            self._calls[event.index] = self._start_block(
                "tool_use", ToolCallTrack(id=event.id, name=event.name)
            )
        elif isinstance(event, ToolCallArgsDelta):
            self._call_delta(event.index, event.delta, final=None)
        elif isinstance(event, ToolCallEnd):
            self._call_delta(event.index, "", final=event.arguments)
        elif isinstance(event, Finish):
            self._finish = event
            self._stop_open()
        elif isinstance(event, Usage):
            self._usage = event
        return self._take()

    def close(self) -> list[str]:
        self._ensure_started()
        if self._closed:
            return []
        self._closed = True
        self._stop_open()
        finish = self._finish
        if finish is None or finish.reason in FAILED:
            error = anthropic_error_body(failure_message(finish), status=500)
            self._emit("error", error=error["error"])
            return self._take()
        stop_reason, stop_sequence = self._stop_reason()
        self._emit(
            "message_delta",
            delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage=self._usage_json(),
        )
        self._emit("message_stop")
        return self._take()

    def _stop_reason(self) -> tuple[str, str | None]:
        assert self._finish is not None
        if self._finish.reason == "length":
            return "max_tokens", None  # a tool call cut here is not reported as tool_use
        if any(b.call is not None and b.call.done for b in self._blocks):
            return "tool_use", None
        if self._finish.stop_sequence is not None:
            return "stop_sequence", self._finish.stop_sequence
        return "end_turn", None

    def body(self) -> dict[str, Any]:
        """The non-streamed `message`; raises GenerationError when generation failed.

        A tool call the token limit cut off is left out: its input is not a complete object.
        """
        if self._finish is None or self._finish.reason in FAILED:
            raise GenerationError(failure_message(self._finish))
        stop_reason, stop_sequence = self._stop_reason()
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [b.to_json() for b in self._blocks if b.call is None or b.call.done],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage_json(),
        }


def build_message(
    events: Iterable[Event], *, message_id: str, model: str, prompt_tokens: int = 0, cached_tokens: int = 0
) -> dict[str, Any]:
    """The `message` body for a non-streamed request whose events are all known."""
    encoder = MessagesEncoder(
        message_id=message_id,
        model=model,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        stream=False,
    )
    for event in events:
        encoder.feed(event)
    encoder.close()
    return encoder.body()
