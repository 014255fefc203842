"""Chat Completions output: canonical events -> `chat.completion` bodies and chunk streams."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.recipe.api._output import (
    FAILED,
    GenerationError,
    ToolCallTrack,
    failure_message,
    logprob_entries,
    merge_usage,
)
from deepinfer.recipe.api.error_bodies import openai_error_body
from deepinfer.recipe.api.sse import SSE_DONE, sse_frame
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


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, ToolCallTrack] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] | None = None
    unsent_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: Finish | None = None
    usage: Usage | None = None

    @property
    def finish_reason(self) -> str:
        # A tool call cut by the token limit is not a tool call: the answer is "length".
        if self.finish is not None and self.finish.reason == "length":
            return "length"
        return "tool_calls" if any(c.done for c in self.calls.values()) else "stop"


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


class ChatCompletionEncoder:
    """Turns the event streams of a request's choices into `chat.completion.chunk` SSE frames.

    `feed(event, index)` returns the frames to send now; `close()` returns the last ones (usage
    chunk when asked for, or an error frame, then `[DONE]`). With `stream=False` no frames are
    built and `body()` gives the `chat.completion` object.
    """

    def __init__(
        self,
        *,
        completion_id: str,
        model: str,
        created: int,
        n: int = 1,
        include_usage: bool = False,
        stream: bool = True,
    ) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._stream = stream
        self._choices = [_Choice(index=i) for i in range(n)]
        self._frames: list[str] = []
        self._started = False
        self._closed = False

    # -- frames

    def _chunk(self, choice: _Choice, delta: dict[str, Any], finish_reason: str | None = None) -> None:
        if not self._stream:
            return
        logprobs = None
        if choice.unsent_logprobs:
            logprobs = {"content": choice.unsent_logprobs, "refusal": None}
            choice.unsent_logprobs = []
        entry = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        self._frames.append(sse_frame(self._envelope([entry])))

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None  # every chunk but the last carries a null usage, as OpenAI does
        return body

    def _take(self) -> list[str]:
        frames, self._frames = self._frames, []
        return frames

    # -- public

    def start(self) -> list[str]:
        """The first chunk of every choice, in index order (the SDK's accumulator relies on it)."""
        self._ensure_started()
        return self._take()

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            for choice in self._choices:
                self._chunk(choice, {"role": "assistant", "content": ""})

    def feed(self, event: Event, index: int = 0) -> list[str]:
        self._ensure_started()
        choice = self._choices[index]
        if choice.finish is not None and not isinstance(event, Usage):
            return self._take()
        if isinstance(event, TextDelta):
            if event.text:
                choice.text.append(event.text)
                self._chunk(choice, {"content": event.text})
        elif isinstance(event, ReasoningDelta):
            if event.text:
                choice.reasoning.append(event.text)
                self._chunk(choice, {"reasoning_content": event.text})
        elif isinstance(event, ToolCallStart):
            choice.calls[event.index] = ToolCallTrack(id=event.id, name=event.name)
            head = {"index": event.index, "id": event.id, "type": "function"}
            self._chunk(choice, {"tool_calls": [{**head, "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallArgsDelta):
            delta = choice.calls[event.index].append(event.delta)
            if delta:
                self._chunk(
                    choice, {"tool_calls": [{"index": event.index, "function": {"arguments": delta}}]}
                )
        elif isinstance(event, ToolCallEnd):
            rest = choice.calls[event.index].finish(event.arguments)
            if rest:
                self._chunk(choice, {"tool_calls": [{"index": event.index, "function": {"arguments": rest}}]})
        elif isinstance(event, Logprobs):
            entries = logprob_entries(event)
            choice.logprobs = (choice.logprobs or []) + entries
            choice.unsent_logprobs.extend(entries)
        elif isinstance(event, Finish):
            choice.finish = event
            if event.reason not in FAILED:
                self._chunk(choice, {}, choice.finish_reason)
        elif isinstance(event, Usage):
            choice.usage = event
        return self._take()

    def close(self) -> list[str]:
        self._ensure_started()
        if self._closed:
            return []
        self._closed = True
        failed = self._failed()
        if not self._stream:
            return []
        if failed is not None:
            self._frames.append(sse_frame(openai_error_body(failure_message(failed.finish), status=500)))
        elif self.include_usage:
            usage = merge_usage(c.usage for c in self._choices)
            envelope = self._envelope([])
            envelope["usage"] = _usage_json(usage) if usage else None
            self._frames.append(sse_frame(envelope))
        self._frames.append(SSE_DONE)
        return self._take()

    def _failed(self) -> _Choice | None:
        for choice in self._choices:
            if choice.finish is None or choice.finish.reason in FAILED:
                return choice
        return None

    def body(self) -> dict[str, Any]:
        """The non-streamed `chat.completion`; raises GenerationError when a choice failed."""
        failed = self._failed()
        if failed is not None:
            raise GenerationError(failure_message(failed.finish))
        usage = merge_usage(c.usage for c in self._choices)
        return {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [_choice_json(c) for c in self._choices],
            "usage": _usage_json(usage) if usage else None,
        }


def _choice_json(choice: _Choice) -> dict[str, Any]:
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in choice.calls.values()
        if c.done
    ]
    text = "".join(choice.text)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if choice.reasoning:
        message["reasoning_content"] = "".join(choice.reasoning)
    if calls:
        message["tool_calls"] = calls
    logprobs = None if choice.logprobs is None else {"content": choice.logprobs, "refusal": None}
    return {
        "index": choice.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }


def build_chat_completion(
    choices: Sequence[Iterable[Event]], *, completion_id: str, model: str, created: int
) -> dict[str, Any]:
    """The `chat.completion` body for choices whose events are all known (non-streamed request)."""
    encoder = ChatCompletionEncoder(
        completion_id=completion_id, model=model, created=created, n=len(choices), stream=False
    )
    for index, events in enumerate(choices):
        for event in events:
            encoder.feed(event, index)
    encoder.close()
    return encoder.body()
