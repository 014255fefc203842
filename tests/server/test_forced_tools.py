"""Forced tool calls through the real server and the real SDKs: tool_choice `required` / named
(OpenAI) and `any` / `tool` (Anthropic) always give well-formed calls in the model's own syntax
(Hermes `<tool_call>` for the default SmolLM2 template) whose arguments validate against the
tool's schema; `auto` stays free and `none` offers no tools at all."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.structured.validation import strict_validator

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z_]+$", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
RESPONSES_TOOLS = [
    {"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()
]
ANTHROPIC_TOOLS = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# A call takes about 30 tokens; parallel calls may use up the rest.
MAX_TOKENS = 64


def _check_call(name: str, arguments: str | dict) -> dict:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    strict_validator(SCHEMAS[name]).validate(value)
    return value


def test_chat_required_single_call_sampled(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        n=2,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and not choice.message.content, choice
        assert calls[0].type == "function" and calls[0].id.startswith("call_")
        _check_call(calls[0].function.name, calls[0].function.arguments)


def test_chat_required_parallel_calls_all_valid(oai: openai.OpenAI) -> None:
    """Several calls are allowed (the default); each one that completes is valid. A call the
    token limit cuts short is not reported as a call."""
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        _check_call(call.function.name, call.function.arguments)


def test_chat_named_tool_is_the_one_called(oai: openai.OpenAI) -> None:
    # The question is about the weather, yet the named tool is the one called.
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=1,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    _check_call("get_time", calls[0].function.arguments)


def test_chat_forced_call_streamed_with_the_sdk_helper(oai: openai.OpenAI) -> None:
    with oai.chat.completions.stream(
        model=MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert [e.arguments for e in done] == [calls[0].function.arguments]  # the deltas add up
    _check_call("get_weather", calls[0].function.arguments)


def test_responses_required(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL,
        input=QUESTION[0]["content"],
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS,
        temperature=0.8,
    )
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.output_text == ""
    _check_call(calls[0].name, calls[0].arguments)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_time"}],
    ids=["any", "tool"],
)
def test_messages_forced(claude: anthropic.Anthropic, tool_choice: dict) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice=tool_choice,  # type: ignore[arg-type]
        extra_body={"temperature": 0.8, "seed": 2},
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["tool_use"], message.content
    block = message.content[0]
    assert tool_choice["type"] == "any" or block.name == "get_time"
    _check_call(block.name, block.input)  # type: ignore[arg-type]


def test_messages_forced_streamed(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as stream:
        partial = "".join(event.partial_json for event in stream if event.type == "input_json")
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [block.type for block in final.content] == ["tool_use"]
    block = final.content[0]
    assert block.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(partial) == block.input  # type: ignore[union-attr]
    _check_call("get_weather", block.input)  # type: ignore[union-attr, arg-type]


# Cut points inside the one call a forced request writes (about 30 tokens, see MAX_TOKENS).
CUTS = (3, 9, 17, 24)


@pytest.mark.parametrize("max_tokens", CUTS)
def test_messages_call_cut_by_max_tokens_is_never_text(claude: anthropic.Anthropic, max_tokens: int) -> None:
    """The anthropic SDK, `tool_choice: any` and a small max_tokens: the cut call is not a text
    block (once it was raw `<tool_call>{…` markup), and the stop reason is `max_tokens`."""
    request = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": QUESTION,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0},
    }
    message = claude.messages.create(**request)  # type: ignore[arg-type]
    assert message.stop_reason == "max_tokens"
    assert message.content == [] and message.usage.output_tokens == max_tokens  # the call is cut
    with claude.messages.stream(**request) as stream:  # type: ignore[arg-type]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert texts == [] and final.stop_reason == "max_tokens"
    assert [block.type for block in final.content] in ([], ["tool_use"])  # its start, if it came


@pytest.mark.parametrize("max_tokens", CUTS)
def test_openai_call_cut_by_max_tokens_is_never_text(oai: openai.OpenAI, max_tokens: int) -> None:
    """The same cut through Chat Completions (plain and streamed) and Responses: no content."""
    chat = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": OPENAI_TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    choice = oai.chat.completions.create(**chat).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    chunks = list(oai.chat.completions.create(**chat, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    response = oai.responses.create(
        model=MODEL,
        input=QUESTION[0]["content"],
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=max_tokens,
        temperature=0,
    )
    assert response.status == "incomplete" and response.output_text == ""
    assert all(item.type != "message" for item in response.output)


def test_tool_choice_none_offers_no_tools(oai: openai.OpenAI, http: httpx.Client) -> None:
    """`none` renders the prompt without the tools, so the model cannot be told to call one and
    any tool syntax it writes stays text."""

    def prompt_tokens(**fields: object) -> int:
        reply = http.post("/tokenize", json={"model": MODEL, "messages": QUESTION, **fields})
        assert reply.status_code == 200, reply.text
        return reply.json()["count"]

    bare = prompt_tokens()
    assert prompt_tokens(tools=OPENAI_TOOLS, tool_choice="none") == bare
    assert prompt_tokens(tools=OPENAI_TOOLS) > bare + 20
    reply = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens == bare
