"""Chat Completions request bodies (as the real OpenAI SDK sends them) -> Conversation IR."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from deepinfer.recipe.api.chat_completions import chat_completion_to_conversation
from deepinfer.recipe.api.chat_completions_encoder import build_chat_completion
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import (
    Conversation,
    GenerationParams,
    ImagePart,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)
from tests.recipe_api.harness import Recorder, json_response, openai_client, text_events

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER_SCHEMA},
}


def _sdk_body(**kwargs: Any) -> dict[str, Any]:
    """Send a request through the real SDK and return the JSON body it put on the wire."""
    recorder = Recorder(
        lambda body: json_response(
            build_chat_completion([text_events()], completion_id="c", model="m", created=1)
        )
    )
    openai_client(recorder).chat.completions.create(**kwargs)
    return recorder.bodies[0]


def test_full_request_from_sdk_maps_every_field() -> None:
    body = _sdk_body(
        model="smol",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather in Paris?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        max_completion_tokens=64,
        temperature=0.3,
        top_p=0.9,
        n=2,
        stop=["END", "STOP"],
        seed=7,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"50256": -100},
        user="user-1",
        stream=False,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "cache_salt": "tenant-a",
            "traffic_class": "batch",
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    expected = Conversation(
        messages=[
            Message(role="system", content=[TextPart("Be brief.")]),
            Message(role="developer", content=[TextPart("Use tools.")]),
            Message(
                role="user",
                content=[
                    TextPart("Weather in Paris?"),
                    ImagePart(
                        url="data:image/png;base64,iVBORw0KGgo=",
                        media_type="image/png",
                        path="messages[2].content[1]",
                    ),
                ],
            ),
            Message(
                role="assistant",
                reasoning=[Reasoning(text="Need the tool.")],
                tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')],
            ),
            Message(role="tool", content=[TextPart("18C, sunny")], tool_call_id="call_1", name="get_weather"),
        ],
        tools=[Tool(name="get_weather", description="Current weather", parameters=WEATHER_SCHEMA)],
        tool_choice=ToolChoice(mode="named", name="get_weather"),
        thinking=Thinking(enabled=False),
        params=GenerationParams(
            max_tokens=64,
            temperature=0.3,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            repetition_penalty=1.1,
            seed=7,
            n=2,
            stop=["END", "STOP"],
            logprobs=True,
            top_logprobs=2,
            logit_bias={50256: -100.0},
            min_tokens=2,
            ignore_eos=True,
        ),
        response_format=ResponseFormat(
            type="json_schema", json_schema={"type": "object"}, name="answer", strict=True
        ),
        model="smol",
        stream=False,
        cache_salt="tenant-a",
        traffic_class="batch",
        user="user-1",
    )
    assert chat_completion_to_conversation(body) == expected


def test_minimal_request_uses_engine_defaults() -> None:
    body = _sdk_body(model="smol", messages=[{"role": "user", "content": "hi"}])
    conversation = chat_completion_to_conversation(body)
    assert conversation.messages == [Message(role="user", content=[TextPart("hi")])]
    assert conversation.params == GenerationParams()
    assert conversation.thinking == Thinking()
    assert conversation.tool_choice == ToolChoice(mode="auto")
    assert conversation.response_format is None


def test_stream_options_include_usage_only_when_streaming() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}
    assert chat_completion_to_conversation({**base, "stream": True}).include_usage is True
    assert chat_completion_to_conversation(base).include_usage is False


def test_tool_call_arguments_are_never_re_encoded() -> None:
    raw_text = '{"city":"Paris",  "unit":"c"}'  # odd spacing must survive byte for byte
    body = {
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": raw_text}},
                    {
                        "id": "b",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"city": "Zürich"}},
                    },
                ],
            },
        ]
    }
    calls = chat_completion_to_conversation(body).messages[1].tool_calls
    assert calls[0].arguments == raw_text
    assert calls[1].arguments == '{"city": "Zürich"}'  # a dict is encoded exactly once


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"reasoning_effort": "none"}, Thinking(enabled=False, effort="none")),
        ({"reasoning_effort": "high"}, Thinking(enabled=True, effort="high")),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            Thinking(enabled=True, budget_tokens=2048),
        ),
        ({"thinking": {"type": "disabled"}}, Thinking(enabled=False)),
        ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "none"}, Thinking(enabled=True)),
        (
            {"chat_template_kwargs": {"enable_thinking": False}, "thinking": {"type": "enabled"}},
            Thinking(False),
        ),
    ],
)
def test_thinking_toggles(extra: dict[str, Any], expected: Thinking) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    assert chat_completion_to_conversation(body).thinking == expected


def test_reasoning_alias_and_max_tokens_fallback() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "reasoning": "r"},
        ],
        "max_tokens": 9,
        "stop": "\n\n",
        "top_k": -1,
    }
    conversation = chat_completion_to_conversation(body)
    assert conversation.messages[1].reasoning == [Reasoning(text="r")]
    assert conversation.params.max_tokens == 9
    assert conversation.params.stop == ["\n\n"]
    assert conversation.params.top_k is None


def test_unknown_fields_are_ignored() -> None:
    body = {
        "messages": [{"role": "user", "content": "x", "some_future_field": 1}],
        "service_tier": "auto",
        "store": True,
        "metadata": {"a": "b"},
    }
    assert chat_completion_to_conversation(body).messages[0].text == "x"


GOOD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _with(path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(GOOD)
    body[path] = value
    return body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_with("temperature", -0.1), "temperature"),
        (_with("temperature", 2.5), "temperature"),
        (_with("temperature", "0.5"), "temperature"),
        (_with("top_p", 0), "top_p"),
        (_with("top_p", 1.5), "top_p"),
        (_with("n", 0), "n"),
        (_with("max_tokens", 0), "max_tokens"),
        (_with("max_completion_tokens", -5), "max_completion_tokens"),
        (_with("presence_penalty", 3), "presence_penalty"),
        (_with("top_logprobs", 2), "top_logprobs"),
        (_with("logit_bias", {"abc": 1}), "logit_bias.abc"),
        (_with("logit_bias", {"5": 101}), "logit_bias.5"),
        (_with("stop", ["ok", ""]), "stop[1]"),
        (_with("tool_choice", "sometimes"), "tool_choice"),
        (_with("tool_choice", "required"), "tool_choice"),
        (
            _with("tool_choice", {"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (_with("tool_choice", {"type": "function"}), "tool_choice.function"),
        (_with("response_format", {"type": "yaml"}), "response_format.type"),
        (_with("response_format", {"type": "json_schema"}), "response_format.json_schema"),
        (_with("reasoning_effort", "extreme"), "reasoning_effort"),
        (_with("chat_template_kwargs", {"enable_thinking": "yes"}), "chat_template_kwargs.enable_thinking"),
        (_with("min_tokens", 10) | {"max_tokens": 5}, "min_tokens"),
        (_with("messages", []), "messages"),
        (_with("messages", "hello"), "messages"),
        (_with("messages", [{"content": "no role"}]), "messages[0].role"),
        (_with("messages", [{"role": "robot", "content": "x"}]), "messages[0].role"),
        (_with("messages", [{"role": "user"}]), "messages[0].content"),
        (_with("messages", [{"role": "user", "content": 5}]), "messages[0].content"),
        (_with("messages", [{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
        (
            _with("messages", [{"role": "user", "content": [{"type": "audio"}]}]),
            "messages[0].content[0].type",
        ),
        (
            _with("messages", [{"role": "system", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0].type",
        ),
        (_with("messages", [{"role": "tool", "content": "42"}]), "messages[0].tool_call_id"),
        (
            _with("messages", [{"role": "tool", "tool_call_id": "x", "content": "4"}]),
            "messages[0].tool_call_id",
        ),
        (
            _with(
                "messages",
                [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}],
            ),
            "messages[0].tool_calls[0].function.name",
        ),
        (
            _with("tools", [{"type": "function", "function": {"description": "no name"}}]),
            "tools[0].function.name",
        ),
        (_with("tools", [{"type": "web_search"}]), "tools[0].type"),
    ],
)
def test_bad_values_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RecipeError) as caught:
        chat_completion_to_conversation(body)
    assert caught.value.param == param
    assert str(caught.value).startswith(f"{param}: ")


def test_body_must_be_an_object() -> None:
    with pytest.raises(RecipeError, match="expected a JSON object"):
        chat_completion_to_conversation(["not", "an", "object"])
