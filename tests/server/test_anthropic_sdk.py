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
# Ends by itself: "The answer is 4." (see MESSAGES in test_openai_sdk.py)
QUESTION = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
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


# Claude Code's request shape (without --bare): cached system blocks, then its environment block
# as a `system` entry among the messages, streamed, with tools and metadata.
CLAUDE_CODE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Answer in a few words.", "cache_control": {"type": "ephemeral"}},
]
CLAUDE_CODE_ENV = "<env>\nWorking directory: /tmp/project\nPlatform: linux\n</env>"
CLAUDE_CODE_MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is 2 + 2?", "cache_control": {"type": "ephemeral"}}],
    },
    {"role": "system", "content": [{"type": "text", "text": CLAUDE_CODE_ENV}]},
]


def test_system_entries_among_messages_join_the_system_prompt(claude: anthropic.Anthropic) -> None:
    request = {
        "model": MODEL,
        "system": CLAUDE_CODE_SYSTEM,
        "messages": CLAUDE_CODE_MESSAGES,
        "tools": [WEATHER_TOOL],
        "metadata": {"user_id": "user_abc_account__session_1"},
        "max_tokens": 8,
    }
    with claude.messages.stream(**request, **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    # The entry is appended to the system prompt after the top-level blocks, a blank line
    # between: the same prompt as one system holding both (the string form counts the same).
    counted = claude.messages.count_tokens(
        model=MODEL, system=CLAUDE_CODE_SYSTEM, messages=CLAUDE_CODE_MESSAGES, tools=[WEATHER_TOOL]
    )
    merged = [*CLAUDE_CODE_SYSTEM, {"type": "text", "text": "\n\n" + CLAUDE_CODE_ENV}]
    one_system = claude.messages.count_tokens(
        model=MODEL, system=merged, messages=CLAUDE_CODE_MESSAGES[:1], tools=[WEATHER_TOOL]
    )
    as_string = [{"role": "system", "content": CLAUDE_CODE_ENV}]
    assert (
        counted.input_tokens
        == one_system.input_tokens
        == claude.messages.count_tokens(
            model=MODEL,
            system=CLAUDE_CODE_SYSTEM,
            messages=CLAUDE_CODE_MESSAGES[:1] + as_string,
            tools=[WEATHER_TOOL],
        ).input_tokens
    )
    usage = final.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    # Without the entry the prompt is shorter: it was not dropped.
    bare = claude.messages.count_tokens(
        model=MODEL, system=CLAUDE_CODE_SYSTEM, messages=CLAUDE_CODE_MESSAGES[:1], tools=[WEATHER_TOOL]
    )
    assert counted.input_tokens > bare.input_tokens + 10
