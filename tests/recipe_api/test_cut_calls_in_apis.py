"""A tool call cut by the end of the output never reaches any API's text: the parser's events
for each tool format (tests/recipe/test_parse_cut_calls.py), cut at points all through the
markup, encoded by the Chat Completions, Messages and Responses encoders, streamed and not.
The text each API carries is the answer before the markup; the finish says the limit.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from deepinfer.recipe.api.chat_completions_encoder import ChatCompletionEncoder, build_chat_completion
from deepinfer.recipe.api.messages_encoder import MessagesEncoder, build_message
from deepinfer.recipe.api.responses_encoder import ResponsesEncoder, build_response
from deepinfer.recipe.events import Usage
from deepinfer.recipe.parse import StreamParser
from tests.recipe.conftest import counting_ids
from tests.recipe.test_parse_cut_calls import ANSWER, FORMATS
from tests.recipe_api.harness import decode_sse

CUTS_PER_FORMAT = 12


def _events(name: str, cut: int) -> list[Any]:
    """The parser's events for the output cut at `cut` characters into its markup, fed one
    character at a time (as a stream of tokens arrives), then the limit."""
    spec, head, gap, markup, _ = FORMATS[name]
    output = (head + ANSWER + gap + markup)[: len(head + ANSWER) + cut]
    parser = StreamParser(spec, id_factory=counting_ids())
    events = [e for ch in output for e in parser.feed(ch)]
    return [*events, *parser.finish("length"), Usage(20, 30)]


def _payloads(frames: list[str]) -> list[dict[str, Any]]:
    return [json.loads(data) for _, data in decode_sse(frames) if data != "[DONE]"]


def _streamed(encoder: Any, events: list[Any]) -> list[dict[str, Any]]:
    frames = encoder.start()
    for event in events:
        frames += encoder.feed(event)
    return _payloads(frames + encoder.close())


def _texts(events: list[Any]) -> dict[str, tuple[str, str]]:
    """(text, finish) as each API and mode gives them."""
    chat = build_chat_completion([events], completion_id="c", model="m", created=1)["choices"][0]
    chunks = _streamed(ChatCompletionEncoder(completion_id="c", model="m", created=1, n=1), events)
    message = build_message(events, message_id="msg", model="m")
    frames = _streamed(MessagesEncoder(message_id="msg", model="m"), events)
    response = build_response(events, response_id="r", model="m", created_at=1)
    items = _streamed(ResponsesEncoder(response_id="r", model="m", created_at=1), events)
    return {
        "chat": (chat["message"]["content"] or "", chat["finish_reason"]),
        "chat-stream": (
            "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
            next(
                c["choices"][0]["finish_reason"]
                for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]
            ),
        ),
        "messages": (
            "".join(b["text"] for b in message["content"] if b["type"] == "text"),
            message["stop_reason"],
        ),
        "messages-stream": (
            "".join(f["delta"].get("text", "") for f in frames if f["type"] == "content_block_delta"),
            next(f["delta"]["stop_reason"] for f in frames if f["type"] == "message_delta"),
        ),
        "responses": (
            "".join(
                part["text"]
                for item in response["output"]
                if item["type"] == "message"
                for part in item["content"]
                if part["type"] == "output_text"
            ),
            response["status"],
        ),
        "responses-stream": (
            "".join(p["delta"] for p in items if p["type"] == "response.output_text.delta"),
            items[-1]["type"].removeprefix("response."),
        ),
    }


FINISH = {
    "chat": "length",
    "chat-stream": "length",
    "messages": "max_tokens",
    "messages-stream": "max_tokens",
    "responses": "incomplete",
    "responses-stream": "incomplete",
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_cut_call_is_no_text_in_any_api(name: str) -> None:
    markup = FORMATS[name][3]
    step = max(1, len(markup) // CUTS_PER_FORMAT)
    for cut in [1, *range(step, len(markup), step), len(markup) - 1]:
        texts = _texts(_events(name, cut))
        for api, (text, finish) in texts.items():
            assert text.strip() == ANSWER, (name, cut, api, text)
            assert finish == FINISH[api], (name, cut, api, finish)
