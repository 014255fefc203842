"""The real `anthropic` SDK against the real server: Messages (plain, streamed), count_tokens."""

from __future__ import annotations

import anthropic
import pytest

from tests.server.conftest import MODEL

SYSTEM = [
    {"type": "text", "text": "You are a terse assistant."},
    {"type": "text", "text": "Answer in a few words."},
]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]  # ends by itself: "The answer is 4."
# This SDK no longer has a `temperature` argument; the server still honors the field (greedy here).
GREEDY = {"extra_body": {"temperature": 0}}
# Greedy, this prompt ends by itself well inside the bound (see COLORS in test_openai_sdk.py).
COLORS = {"model": MODEL, "messages": QUESTION, "max_tokens": 64, **GREEDY}


@pytest.fixture(scope="module")
def colors(claude: anthropic.Anthropic):
    return claude.messages.create(**COLORS)


def test_messages_plain_with_system_blocks_and_tools(claude: anthropic.Anthropic) -> None:
    request = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": QUESTION,
        "tools": [WEATHER_TOOL],
        "max_tokens": 4,
    }
    message = claude.messages.create(**request, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert message.content, message
    for block in message.content:
        assert block.type in ("text", "tool_use")
        if block.type == "tool_use":
            assert block.name == "get_weather" and isinstance(block.input, dict)
    # Anthropic counts cache reads apart from input tokens; together they are the prompt.
    counted = claude.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=QUESTION, tools=[WEATHER_TOOL]
    )
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert 1 <= usage.output_tokens <= 4
    # The system blocks and the tool are part of the prompt.
    bare = claude.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert counted.input_tokens > bare.input_tokens + 20


def test_messages_stream_matches_plain(claude: anthropic.Anthropic, colors) -> None:
    with claude.messages.stream(**COLORS) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == colors.content[0].text
    assert final.stop_reason == colors.stop_reason == "end_turn"
    assert final.usage.output_tokens == colors.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        colors.usage.input_tokens + (colors.usage.cache_read_input_tokens or 0)
    )


def test_messages_stop_sequences(claude: anthropic.Anthropic, colors) -> None:
    full = colors.content[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    with claude.messages.stream(**COLORS, stop_sequences=["no-such-text", stop]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert "".join(texts) == final.content[0].text == full[: full.index(stop)]


def test_models_list_through_the_anthropic_sdk(claude: anthropic.Anthropic) -> None:
    assert [m.id for m in claude.models.list()] == [MODEL]
