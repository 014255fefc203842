"""The recipe's API encoders behind the EventSink interface the generation loop drives."""

from __future__ import annotations

from typing import Any

from deepinfer.frontend.output_processor import SequenceDelta
from deepinfer.recipe.api import ChatCompletionEncoder, MessagesEncoder, ResponsesEncoder
from deepinfer.recipe.api.sse import SSE_KEEPALIVE
from deepinfer.recipe.events import Event


class ChatSink:
    def __init__(self, encoder: ChatCompletionEncoder) -> None:
        self.encoder = encoder

    def opening(self) -> list[str]:
        return []

    def first_output(self, delta: SequenceDelta) -> list[str]:
        return []

    def keepalive(self) -> list[str]:
        return [SSE_KEEPALIVE]

    def feed(self, index: int, event: Event) -> list[str]:
        return self.encoder.feed(event, index)

    def close(self) -> list[str]:
        return self.encoder.close()

    def body(self) -> dict[str, Any]:
        return self.encoder.body()


class ResponsesSink:
    """Responses has one choice; its `response.created` goes out at once, before the prefill
    (agents such as Codex give up on a stream that stays silent)."""

    def __init__(self, encoder: ResponsesEncoder) -> None:
        self.encoder = encoder

    def opening(self) -> list[str]:
        return self.encoder.start()

    def first_output(self, delta: SequenceDelta) -> list[str]:
        return self.encoder.start()

    def keepalive(self) -> list[str]:
        return [SSE_KEEPALIVE]

    def feed(self, index: int, event: Event) -> list[str]:
        return self.encoder.feed(event)

    def close(self) -> list[str]:
        return self.encoder.close()

    def body(self) -> dict[str, Any]:
        return self.encoder.body()


class MessagesSink:
    """The encoder is made at the first output, when the prefix-cache hit is known: Anthropic's
    `message_start` reports input tokens net of cache reads. A prefill longer than the keep-alive
    interval cannot wait for it: `message_start` then goes out at the first keep-alive, counting
    no cache read (the cumulative usage of `message_delta` has the real split), and `ping`
    events follow, as Anthropic's API sends them."""

    def __init__(self, *, message_id: str, model: str, prompt_tokens: int, stream: bool) -> None:
        self._options: dict[str, Any] = {
            "message_id": message_id,
            "model": model,
            "prompt_tokens": prompt_tokens,
            "stream": stream,
        }
        self._encoder: MessagesEncoder | None = None

    def _made(self, cached_tokens: int = 0) -> MessagesEncoder:
        if self._encoder is None:
            self._encoder = MessagesEncoder(**self._options, cached_tokens=cached_tokens)
        return self._encoder

    def opening(self) -> list[str]:
        return []

    def first_output(self, delta: SequenceDelta) -> list[str]:
        return self._made(delta.num_cached_tokens).start()

    def keepalive(self) -> list[str]:
        encoder = self._made()
        return encoder.start() or encoder.ping()

    def feed(self, index: int, event: Event) -> list[str]:
        return self._made().feed(event)

    def close(self) -> list[str]:
        return self._made().close()

    def body(self) -> dict[str, Any]:
        return self._made().body()
