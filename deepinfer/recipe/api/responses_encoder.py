"""Responses output: canonical events -> the `response` object and its stream events."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer.recipe.api._output import (
    FAILED,
    GenerationError,
    ToolCallTrack,
    failure_message,
    logprob_entries,
)
from deepinfer.recipe.api.sse import sse_frame
from deepinfer.recipe.events import (
    Event,
    Finish,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from deepinfer.recipe.ir import Tool


def default_echo() -> dict[str, Any]:
    """The request settings a `response` repeats, for a request that set none of them.

    The server passes `response_echo(request)` instead (same keys, the request's values).
    """
    return {
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "background": False,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": None,
        "top_p": None,
        "truncation": "disabled",
        "user": None,
        "prompt_cache_key": None,
    }


ItemKind = Literal["reasoning", "message", "function_call", "custom_tool_call"]
_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc", "custom_tool_call": "ctc"}


@dataclass(slots=True)
class _OpenItem:
    kind: ItemKind
    output_index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    unsent_logprobs: list[dict[str, Any]] = field(default_factory=list)
    call: ToolCallTrack | None = None


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


class ResponsesEncoder:
    """Turns one choice's events into Responses stream events (and the final `response`).

    Output items are strictly sequential: a reasoning item, a message or a function call is
    closed (`.done` events) before the next one is added. `close()` emits `response.completed`,
    `response.incomplete` (token limit) or `response.failed`.

    `tools` (the request's): calls of a namespaced function become `function_call` items with
    `namespace` and the function's own `name`; calls of a custom tool become `custom_tool_call`
    items holding its text `input`. `seal_reasoning`: reasoning items carry their text encrypted
    in `encrypted_content` (the client asked for it with `include`). `queued` (a background
    response): the stream opens with `response.created` and `response.queued`, and
    `response.in_progress` follows when the engine starts producing (`running()`).

    After `close()` or `cancel()`, `result` is the `response` object of the closing event.
    """

    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        created_at: int,
        echo: dict[str, Any] | None = None,
        stream: bool = True,
        tools: Sequence[Tool] = (),
        seal_reasoning: Callable[[str], str] | None = None,
        queued: bool = False,
    ) -> None:
        self.response_id = response_id
        self._queued = queued
        self._running = not queued
        self.result: dict[str, Any] | None = None
        self._tools = {t.name: t for t in tools}
        self._seal = seal_reasoning
        self.model = model
        self.created_at = created_at
        self._echo = echo if echo is not None else default_echo()
        self._stream = stream
        self._id_stem = response_id.removeprefix("resp_")
        self._output: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}
        self._held_logprobs: list[dict[str, Any]] = []
        self._sequence = 0
        self._frames: list[str] = []
        self._finish: Finish | None = None
        self._usage: Usage | None = None
        self._started = False
        self._closed = False

    # -- frames

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._stream:
            payload = {"type": kind, "sequence_number": self._sequence, **fields}
            self._frames.append(sse_frame(payload, event=kind))
        self._sequence += 1

    def _take(self) -> list[str]:
        frames, self._frames = self._frames, []
        return frames

    def snapshot(self, status: str) -> dict[str, Any]:
        """The `response` object now, with `status` (no output before the run ends)."""
        running = status in ("queued", "in_progress")
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "output": [] if running else copy.deepcopy(self._output),
            "usage": _usage_json(self._usage) if self._usage and not running else None,
            **self._echo,
        }

    # -- items

    def _add_item(self, kind: ItemKind, item: dict[str, Any]) -> _OpenItem:
        self._close_open("completed")
        index = len(self._output)
        prefix = _ID_PREFIX[kind]
        item = {"id": f"{prefix}_{self._id_stem}_{index}", **item}
        self._output.append(item)
        opened = _OpenItem(kind=kind, output_index=index, item=item)
        self._open = opened
        self._emit("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        if kind == "message":
            opened.logprobs, opened.unsent_logprobs = list(self._held_logprobs), list(self._held_logprobs)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._emit_part("response.content_part.added", opened, part)
        elif kind == "reasoning":
            self._emit_part("response.content_part.added", opened, {"type": "reasoning_text", "text": ""})
        self._held_logprobs = []
        return opened

    def _emit_part(self, kind: str, item: _OpenItem, part: dict[str, Any]) -> None:
        self._emit(kind, item_id=item.item["id"], output_index=item.output_index, content_index=0, part=part)

    def _close_open(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        ids = {"item_id": item.item["id"], "output_index": item.output_index}
        text = "".join(item.text)
        if item.kind == "message":
            self._emit("response.output_text.done", **ids, content_index=0, text=text, logprobs=item.logprobs)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": item.logprobs}
            self._emit_part("response.content_part.done", item, part)
            item.item["content"] = [part]
        elif item.kind == "reasoning":
            self._emit("response.reasoning_text.done", **ids, content_index=0, text=text)
            part = {"type": "reasoning_text", "text": text}
            self._emit_part("response.content_part.done", item, part)
            item.item["content"] = [part]
            if self._seal is not None:
                item.item["encrypted_content"] = self._seal(text)
        elif item.kind == "custom_tool_call" and item.call is not None:
            if item.call.done:
                text = custom_input(item.call.arguments)
                item.item["input"] = text
                if text:
                    self._emit("response.custom_tool_call_input.delta", **ids, delta=text)
                self._emit("response.custom_tool_call_input.done", **ids, input=text)
            else:
                status = "incomplete"
        elif item.call is not None:
            item.item["arguments"] = item.call.arguments
            if item.call.done:
                self._emit("response.function_call_arguments.done", **ids, arguments=item.call.arguments)
            else:
                status = "incomplete"  # cut by the token limit: not a valid call
        item.item["status"] = status
        self._emit("response.output_item.done", output_index=item.output_index, item=copy.deepcopy(item.item))

    def _open_of(self, kind: Literal["reasoning", "message"]) -> _OpenItem:
        if self._open is not None and self._open.kind == kind:
            return self._open
        if kind == "reasoning":
            return self._add_item("reasoning", {"type": "reasoning", "summary": [], "status": "in_progress"})
        return self._add_item(
            "message", {"type": "message", "role": "assistant", "status": "in_progress", "content": []}
        )

    # -- public

    def start(self) -> list[str]:
        """The opening events, sent before the engine produced anything."""
        self._ensure_started()
        return self._take()

    def running(self) -> list[str]:
        """The engine produced its first output: a queued response is now in progress."""
        self._ensure_running()
        return self._take()

    def _ensure_running(self) -> None:
        self._ensure_started()
        if not self._running:
            self._running = True
            self._emit("response.in_progress", response=self.snapshot("in_progress"))

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            status = "queued" if self._queued else "in_progress"
            self._emit("response.created", response=self.snapshot(status))
            self._emit(f"response.{status}", response=self.snapshot(status))

    def feed(self, event: Event) -> list[str]:
        self._ensure_running()
        if self._finish is not None and not isinstance(event, Usage):
            return self._take()
        if isinstance(event, ReasoningDelta) and event.text:
            item = self._open_of("reasoning")
            item.text.append(event.text)
            ids = {"item_id": item.item["id"], "output_index": item.output_index}
            self._emit("response.reasoning_text.delta", **ids, content_index=0, delta=event.text)
        elif isinstance(event, TextDelta) and event.text:
            item = self._open_of("message")
            item.text.append(event.text)
            sent, item.unsent_logprobs = item.unsent_logprobs, []
            ids = {"item_id": item.item["id"], "output_index": item.output_index}
            self._emit("response.output_text.delta", **ids, content_index=0, delta=event.text, logprobs=sent)
        elif isinstance(event, ToolCallStart):
            tool = self._tools.get(event.name)
            if tool is not None and tool.custom:
                base = {"type": "custom_tool_call", "call_id": event.id, "name": event.name, "input": ""}
                item = self._add_item("custom_tool_call", {**base, "status": "in_progress"})
            else:
                base = {"type": "function_call", "call_id": event.id, "name": event.name, "arguments": ""}
                if tool is not None and tool.namespace is not None:
                    base["namespace"], base["name"] = tool.namespace, tool.local_name or event.name
                item = self._add_item("function_call", {**base, "status": "in_progress"})
            item.call = ToolCallTrack(id=event.id, name=event.name)
            self._calls[event.index] = item
        elif isinstance(event, ToolCallArgsDelta):
            self._call_delta(event.index, event.delta, final=None)
        elif isinstance(event, ToolCallEnd):
            self._call_delta(event.index, "", final=event.arguments)
        elif isinstance(event, Logprobs):
            self._logprobs(logprob_entries(event))
        elif isinstance(event, Finish):
            self._finish = event
            self._close_open("incomplete" if event.reason == "length" else "completed")
        elif isinstance(event, Usage):
            self._usage = event
        return self._take()

    def _call_delta(self, index: int, delta: str, final: str | None) -> None:
        item = self._calls[index]
        if item is not self._open or item.call is None:
            return  # a later item already closed this call; its text can no longer be streamed
        sent = item.call.append(delta) if final is None else item.call.finish(final)
        if sent and item.kind == "function_call":
            ids = {"item_id": item.item["id"], "output_index": item.output_index}
            self._emit("response.function_call_arguments.delta", **ids, delta=sent)
        if final is not None:
            self._close_open("completed")

    def _logprobs(self, entries: list[dict[str, Any]]) -> None:
        # Logprobs belong to the message being written; those of reasoning or call tokens are
        # dropped (Responses has no place for them) and those before any item wait for the next.
        if self._open is None:
            self._held_logprobs.extend(entries)
        elif self._open.kind == "message":
            self._open.logprobs.extend(entries)
            self._open.unsent_logprobs.extend(entries)

    def close(self) -> list[str]:
        self._ensure_started()
        if self._closed:
            return []
        self._closed = True
        self._close_open("incomplete")
        finish = self._finish
        if finish is None or finish.reason in FAILED:
            self.result = self.snapshot("failed")
            self.result["error"] = {"code": "server_error", "message": failure_message(finish)}
            self._emit("response.failed", response=self.result)
        else:
            self.result = self._final()
            kind = "response.incomplete" if finish.reason == "length" else "response.completed"
            self._emit(kind, response=self.result)
        return self._take()

    def cancel(self) -> list[str]:
        """End a cancelled response: the open item is left incomplete, and `response.failed`
        carries the response with status `cancelled` (the API has no event of its own for it)."""
        self._ensure_started()
        if self._closed:
            return []
        self._closed = True
        self._close_open("incomplete")
        self.result = self.snapshot("cancelled")
        self._emit("response.failed", response=self.result)
        return self._take()

    def _final(self) -> dict[str, Any]:
        assert self._finish is not None
        if self._finish.reason == "length":
            body = self.snapshot("incomplete")
            body["incomplete_details"] = {"reason": "max_output_tokens"}
            return body
        return self.snapshot("completed")

    def body(self) -> dict[str, Any]:
        """The non-streamed `response` object; raises GenerationError when generation failed."""
        if self._finish is None or self._finish.reason in FAILED:
            raise GenerationError(failure_message(self._finish))
        return self._final()


def custom_input(arguments: str) -> str:
    """A custom tool's text input, from the `{"input": …}` arguments the model wrote."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def build_response(
    events: Iterable[Event],
    *,
    response_id: str,
    model: str,
    created_at: int,
    echo: dict[str, Any] | None = None,
    tools: Sequence[Tool] = (),
    seal_reasoning: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The `response` object for a non-streamed request whose events are all known."""
    encoder = ResponsesEncoder(
        response_id=response_id,
        model=model,
        created_at=created_at,
        echo=echo,
        stream=False,
        tools=tools,
        seal_reasoning=seal_reasoning,
    )
    for event in events:
        encoder.feed(event)
    encoder.close()
    return encoder.body()
