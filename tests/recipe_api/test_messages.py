"""Anthropic Messages: request parsing and output encoding, checked with the Anthropic SDK."""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SdkMessage
from anthropic.types import MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from deepinfer.recipe.api import GenerationError
from deepinfer.recipe.api._output import thinking_signature
from deepinfer.recipe.api.messages import (
    count_tokens_body,
    count_tokens_to_conversation,
    messages_to_conversation,
)
from deepinfer.recipe.api.messages_encoder import MessagesEncoder, build_message
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.events import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, Usage
from deepinfer.recipe.ir import (
    Conversation,
    GenerationParams,
    ImagePart,
    Message,
    Reasoning,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)
from tests.recipe_api.harness import (
    WEATHER_TOOL_ARGS,
    Recorder,
    anthropic_client,
    decode_sse,
    json_response,
    reasoning_text_tool_events,
    sse_response,
    text_events,
)

IDS = {"message_id": "msg_test1", "model": "smol"}
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}


def _encode(events: list[Any], **usage: int) -> list[str]:
    encoder = MessagesEncoder(**IDS, **usage)
    frames = encoder.start()
    for event in events:
        frames += encoder.feed(event)
    return frames + encoder.close()


def _events(frames: list[str]) -> list[dict[str, Any]]:
    decoded = decode_sse(frames)
    payloads = [json.loads(data) for _, data in decoded]
    assert [name for name, _ in decoded] == [p["type"] for p in payloads]
    return payloads


def _accumulate(frames: list[str]) -> Any:
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for payload in _events(frames):
        if payload["type"] == "ping":
            continue  # keep-alive; the SDK's own stream skips it before parsing
        event = STREAM_EVENT.validate_python(payload)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


# ---------------------------------------------------------------- requests


def test_sdk_request_maps_blocks_to_turns() -> None:
    recorder = Recorder(lambda body: json_response(build_message(text_events(), **IDS)))
    anthropic_client(recorder).messages.create(
        model="smol",
        max_tokens=4096,
        system=[
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need the tool.", "signature": "sig-1"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "station offline"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks, and tomorrow?"},
                ],
            },
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2048},
        stop_sequences=["END"],
        metadata={"user_id": "user-7"},
        # This SDK release dropped the sampling arguments; older clients still send them.
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40, "cache_salt": "tenant-b"},
    )
    expected = Conversation(
        messages=[
            Message(role="system", content=[TextPart("You are terse."), TextPart("Use tools.")]),
            Message(
                role="user",
                content=[
                    TextPart("Weather?"),
                    ImagePart(
                        url="data:image/png;base64,iVBO",
                        media_type="image/png",
                        path="messages[0].content[1]",
                    ),
                ],
            ),
            Message(
                role="assistant",
                content=[TextPart("Checking.")],
                reasoning=[
                    Reasoning(text="Need the tool.", signature="sig-1"),
                    Reasoning(redacted_data="opaque"),
                ],
                tool_calls=[
                    ToolCall(id="toolu_1", name="get_weather", arguments='{"city": "Paris"}'),
                    ToolCall(id="toolu_2", name="get_weather", arguments='{"city": "Rome"}'),
                ],
            ),
            Message(role="tool", content=[TextPart("18C")], tool_call_id="toolu_1", name="get_weather"),
            Message(
                role="tool",
                content=[TextPart("station offline")],
                tool_call_id="toolu_2",
                name="get_weather",
                is_error=True,
            ),
            Message(role="user", content=[TextPart("Thanks, and tomorrow?")]),
        ],
        tools=[Tool(name="get_weather", description="Current weather", parameters=WEATHER_SCHEMA)],
        tool_choice=ToolChoice(mode="named", name="get_weather"),
        thinking=Thinking(enabled=True, budget_tokens=2048),
        params=GenerationParams(max_tokens=4096, temperature=0.5, top_p=0.9, top_k=40, stop=["END"]),
        model="smol",
        cache_salt="tenant-b",
        user="user-7",
    )
    assert messages_to_conversation(recorder.bodies[0]) == expected


def test_string_content_system_and_tool_choice_modes() -> None:
    base = {"max_tokens": 10, "system": "Be nice.", "messages": [{"role": "user", "content": "hi"}]}
    conversation = messages_to_conversation(base)
    assert conversation.messages == [
        Message(role="system", content=[TextPart("Be nice.")]),
        Message(role="user", content=[TextPart("hi")]),
    ]
    with_tools = base | {"tools": [WEATHER_TOOL]}
    assert (
        messages_to_conversation(with_tools | {"tool_choice": {"type": "any"}}).tool_choice.mode == "required"
    )
    assert messages_to_conversation(with_tools | {"tool_choice": {"type": "none"}}).tool_choice.mode == "none"
    assert messages_to_conversation(base | {"thinking": {"type": "disabled"}}).thinking == Thinking(
        enabled=False
    )


def test_system_entries_among_messages_stay_in_place_marked() -> None:
    # Claude Code's environment block: a `system` entry among the turns, string or text blocks.
    body = {
        "max_tokens": 10,
        "system": "Be nice.",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {}}]},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "later"},
            {"role": "user", "content": "bye"},
        ],
    }
    assert messages_to_conversation(body).messages == [
        Message(role="system", content=[TextPart("Be nice.")]),
        Message(role="user", content=[TextPart("hi")]),
        Message(role="system", content=[TextPart("env")], in_turns=True),
        Message(role="assistant", content=[TextPart("hello")]),
        Message(role="system", content=[TextPart("later")], in_turns=True),
        Message(role="user", content=[TextPart("bye")]),
    ]


def test_count_tokens_request_through_sdk() -> None:
    recorder = Recorder(lambda body: json_response(count_tokens_body(57)))
    counted = anthropic_client(recorder).messages.count_tokens(
        model="smol",
        system="Be nice.",
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER_TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert isinstance(counted, MessageTokensCount) and counted.input_tokens == 57
    conversation = count_tokens_to_conversation(recorder.bodies[0])
    assert [m.role for m in conversation.messages] == ["system", "user"]
    assert conversation.tools[0].name == "get_weather"
    assert conversation.thinking == Thinking(enabled=True, budget_tokens=1024)


GOOD: dict[str, Any] = {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}


def _with(**fields: Any) -> dict[str, Any]:
    return copy.deepcopy(GOOD) | fields


def _without(field: str) -> dict[str, Any]:
    body = copy.deepcopy(GOOD)
    del body[field]
    return body


def _user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_without("max_tokens"), "max_tokens"),
        (_with(max_tokens=0), "max_tokens"),
        (_with(temperature=1.5), "temperature"),
        (_with(temperature=-0.1), "temperature"),
        (_with(top_p=1.2), "top_p"),
        (_with(stop_sequences=[""]), "stop_sequences[0]"),
        (_with(thinking={"type": "enabled"}), "thinking.budget_tokens"),
        (_with(thinking={"type": "enabled", "budget_tokens": 512}), "thinking.budget_tokens"),
        (_with(thinking={"type": "enabled", "budget_tokens": 4096}), "thinking.budget_tokens"),
        (_with(thinking={"type": "sometimes"}), "thinking.type"),
        (_with(tool_choice={"type": "any"}), "tool_choice.type"),
        (_with(tools=[WEATHER_TOOL], tool_choice={"type": "tool"}), "tool_choice.name"),
        (_with(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "x"}), "tool_choice.name"),
        (_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (_with(tools=[{"name": "f"}]), "tools[0].input_schema"),
        (_with(tools=[{"name": "f", "input_schema": {"type": "string"}}]), "tools[0].input_schema"),
        (_with(system=[{"type": "image"}]), "system[0].type"),
        (_with(messages=[]), "messages"),
        (_with(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (
            _with(messages=[{"role": "system", "content": [{"type": "image", "source": {}}]}]),
            "messages[0].content[0].type",
        ),
        (
            _with(messages=_user({"type": "tool_result", "content": "x"})),
            "messages[0].content[0].tool_use_id",
        ),
        (
            _with(messages=_user({"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"})),
            "messages[0].content[0].tool_use_id",
        ),
        (_with(messages=_user({"type": "document", "source": {}})), "messages[0].content[0].type"),
        (
            _with(messages=_user({"type": "image", "source": {"type": "base64"}})),
            "messages[0].content[0].source.data",
        ),
        (
            _with(
                messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]
            ),
            "messages[0].content[0].id",
        ),
        (
            _with(messages=[{"role": "assistant", "content": [{"type": "thinking"}]}]),
            "messages[0].content[0].thinking",
        ),
    ],
)
def test_bad_values_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RecipeError) as caught:
        messages_to_conversation(body)
    assert caught.value.param == param


# ---------------------------------------------------------------- outputs


def test_body_validates_as_sdk_message() -> None:
    message = SdkMessage.model_validate(build_message(reasoning_text_tool_events(), **IDS))
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
    assert thinking.signature == thinking_signature("The user wants the weather.")
    assert text.type == "text" and text.text == "Let me check that for you."
    assert tool_use.type == "tool_use"
    assert (tool_use.id, tool_use.name, tool_use.input) == (
        "call_w1",
        "get_weather",
        json.loads(WEATHER_TOOL_ARGS),
    )
    assert message.stop_reason == "tool_use" and message.stop_sequence is None


def test_usage_input_tokens_exclude_cached_tokens() -> None:
    usage = SdkMessage.model_validate(build_message(reasoning_text_tool_events(), **IDS)).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
        56,
        64,
        0,
    )
    assert usage.output_tokens == 30
    streamed = _accumulate(_encode(reasoning_text_tool_events(), prompt_tokens=120, cached_tokens=64))
    assert streamed.usage.model_dump() == usage.model_dump()
    start = _events(_encode(reasoning_text_tool_events(), prompt_tokens=120, cached_tokens=64))[0]
    assert start["message"]["usage"]["input_tokens"] == 56


def test_stream_accumulates_to_the_body() -> None:
    events = reasoning_text_tool_events()
    body = SdkMessage.model_validate(build_message(events, **IDS))
    streamed = _accumulate(_encode(events))
    assert streamed.model_dump() == body.model_dump()


def test_blocks_are_closed_before_the_next_opens() -> None:
    payloads = _events(_encode(reasoning_text_tool_events()))
    open_index = None
    started = []
    for payload in payloads:
        if payload["type"] == "content_block_start":
            assert open_index is None, "a block started while another was open"
            open_index = payload["index"]
            started.append(open_index)
        elif payload["type"] == "content_block_delta":
            assert payload["index"] == open_index
        elif payload["type"] == "content_block_stop":
            assert payload["index"] == open_index
            open_index = None
    assert open_index is None
    assert started == [0, 1, 2]
    assert [p["type"] for p in payloads[:2]] == ["message_start", "ping"]
    assert [p["type"] for p in payloads[-2:]] == ["message_delta", "message_stop"]
    signature = [
        p for p in payloads if p["type"] == "content_block_delta" and p["delta"]["type"] == "signature_delta"
    ]
    assert len(signature) == 1 and signature[0]["index"] == 0


def test_no_phantom_empty_text_block() -> None:
    events = [
        ReasoningDelta("thinking only"),
        TextDelta(""),
        ToolCallStart(0, "toolu_1", "get_weather"),
        TextDelta(""),
        Finish("tool_calls"),
        Usage(5, 5),
    ]
    payloads = _events(_encode(events))
    starts = [p["content_block"]["type"] for p in payloads if p["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    body = SdkMessage.model_validate(build_message(events, **IDS))
    assert [b.type for b in body.content] == ["thinking"]  # the call never finished
    assert body.stop_reason == "end_turn"


def test_tool_call_cut_by_max_tokens() -> None:
    events = [
        TextDelta("Let me look."),
        ToolCallStart(0, "toolu_9", "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Pa'),
        Finish("length"),
        Usage(10, 64),
    ]
    body = SdkMessage.model_validate(build_message(events, **IDS))
    assert body.stop_reason == "max_tokens"
    assert [b.type for b in body.content] == ["text"]
    streamed = _accumulate(_encode(events))
    assert streamed.stop_reason == "max_tokens"
    payloads = _events(_encode(events))
    assert payloads[-3]["type"] == "content_block_stop"  # the cut block is still closed


def test_stop_sequence() -> None:
    events = [TextDelta("one two"), Finish("stop", stop_sequence="END"), Usage(3, 2)]
    body = SdkMessage.model_validate(build_message(events, **IDS))
    assert (body.stop_reason, body.stop_sequence) == ("stop_sequence", "END")
    streamed = _accumulate(_encode(events))
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "END")


def test_failure_is_an_error_event() -> None:
    events = [TextDelta("partial"), Finish("error", message="engine crashed")]
    with pytest.raises(GenerationError, match="engine crashed"):
        build_message(events, **IDS)
    payloads = _events(_encode(events))
    assert payloads[-1] == {"type": "error", "error": {"type": "api_error", "message": "engine crashed"}}
    assert not any(p["type"] == "message_stop" for p in payloads)


def test_real_client_end_to_end() -> None:
    def reply(body: dict[str, Any]) -> Any:
        conversation = messages_to_conversation(body)
        assert conversation.tools[0].name == "get_weather"
        usage = {"prompt_tokens": 120, "cached_tokens": 64}
        if not conversation.stream:
            return json_response(build_message(reasoning_text_tool_events(), **IDS, **usage))
        return sse_response(_encode(reasoning_text_tool_events(), **usage))

    client = anthropic_client(Recorder(reply))
    request: dict[str, Any] = {
        "model": "smol",
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
    }
    plain = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Let me check that for you."
    assert final.model_dump(exclude={"content": {2: {"input"}}}) == plain.model_dump(
        exclude={"content": {2: {"input"}}}
    )
    assert final.content[2].input == plain.content[2].input == json.loads(WEATHER_TOOL_ARGS)  # type: ignore[union-attr]


def test_real_client_raises_on_stream_error() -> None:
    frames = _encode([TextDelta("x"), Finish("abort")])
    client = anthropic_client(Recorder(lambda body: sse_response(frames)))
    with (
        pytest.raises(anthropic.APIStatusError, match="aborted"),
        client.messages.stream(
            model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        ) as stream,
    ):
        stream.until_done()
