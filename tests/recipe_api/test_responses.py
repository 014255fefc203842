"""OpenAI Responses: request parsing and output encoding, checked with the OpenAI SDK."""

from __future__ import annotations

import copy
import json
from typing import Any, get_args

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from deepinfer.recipe.api import GenerationError
from deepinfer.recipe.api.responses import (
    ResponsesRequest,
    parse_responses_request,
    request_to_conversation,
    response_echo,
    responses_to_conversation,
)
from deepinfer.recipe.api.responses_encoder import ResponsesEncoder, build_response, default_echo
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.events import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, Usage
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
from tests.recipe_api.harness import (
    WEATHER_TOOL_ARGS,
    Recorder,
    decode_sse,
    json_response,
    openai_client,
    reasoning_text_tool_events,
    sse_response,
    text_events,
)

IDS = {"response_id": "resp_test1", "model": "smol", "created_at": 1_700_000_000}
# One SDK event class per `type`: validating against the whole union builds a huge schema (seconds).
STREAM_EVENT_CLASSES = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": False}


def _encode(events: list[Any], echo: dict[str, Any] | None = None) -> list[str]:
    encoder = ResponsesEncoder(**IDS, echo=echo)
    frames = encoder.start()
    for event in events:
        frames += encoder.feed(event)
    return frames + encoder.close()


def _events(frames: list[str]) -> list[dict[str, Any]]:
    decoded = decode_sse(frames)
    payloads = [json.loads(data) for _, data in decoded]
    assert [name for name, _ in decoded] == [p["type"] for p in payloads]  # `event:` names the type
    return payloads


def _accumulate(frames: list[str]) -> list[Any]:
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[WEATHER_TOOL], text_format=omit)
    seen = []
    for payload in _events(frames):
        seen += state.handle_event(STREAM_EVENT_CLASSES[payload["type"]].model_validate(payload))
    return seen


def _plain(value: Any) -> Any:
    """A dump without the fields the SDK adds client-side (`parsed`, `parsed_arguments`)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- requests


def test_sdk_request_with_items_maps_to_turns() -> None:
    recorder = Recorder(lambda body: json_response(build_response(text_events(), **IDS)))
    openai_client(recorder).responses.create(
        model="smol",
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Use the tool."}],
                "encrypted_content": "opaque",
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "And this?"},
                    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
                ],
            },
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        text={
            "format": {"type": "json_schema", "name": "reply", "schema": {"type": "object"}, "strict": True}
        },
        max_output_tokens=77,
        temperature=0.2,
        top_p=0.8,
        top_logprobs=3,
        reasoning={"effort": "low"},
        store=False,
        user="u-9",
        extra_body={"top_k": 5, "cache_salt": "s1", "traffic_class": "interactive"},
    )
    expected = Conversation(
        messages=[
            Message(role="system", content=[TextPart("Answer briefly.")]),
            Message(role="user", content=[TextPart("Weather in Paris?")]),
            Message(
                role="assistant",
                content=[TextPart("Checking.")],
                reasoning=[Reasoning(text="Use the tool.", redacted_data="opaque")],
                tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')],
            ),
            Message(role="tool", content=[TextPart("18C")], tool_call_id="call_1", name="get_weather"),
            Message(
                role="user",
                content=[
                    TextPart("And this?"),
                    ImagePart(url="https://example.com/a.png", detail="auto", path="input[5].content[1]"),
                ],
            ),
        ],
        tools=[Tool(name="get_weather", parameters=WEATHER_SCHEMA)],
        tool_choice=ToolChoice(mode="named", name="get_weather"),
        thinking=Thinking(enabled=True, effort="low"),
        params=GenerationParams(
            max_tokens=77, temperature=0.2, top_p=0.8, top_k=5, logprobs=True, top_logprobs=3
        ),
        response_format=ResponseFormat(
            type="json_schema", json_schema={"type": "object"}, name="reply", strict=True
        ),
        model="smol",
        cache_salt="s1",
        traffic_class="interactive",
        user="u-9",
    )
    assert responses_to_conversation(recorder.bodies[0]) == expected


def test_string_input_and_json_object_format() -> None:
    conversation = responses_to_conversation(
        {
            "input": "hi",
            "text": {"format": {"type": "json_object"}},
            "reasoning": {"effort": "none"},
            "include": ["message.output_text.logprobs"],
        }
    )
    assert conversation.params.logprobs is True and conversation.params.top_logprobs is None
    assert conversation.messages == [Message(role="user", content=[TextPart("hi")])]
    assert conversation.response_format == ResponseFormat(type="json_object")
    assert conversation.thinking == Thinking(enabled=False, effort="none")


def test_text_after_a_call_starts_a_new_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "after the call"},
    ]
    messages = responses_to_conversation({"input": items}).messages
    assert [m.role for m in messages] == ["user", "assistant", "assistant"]
    assert messages[2].text == "after the call"


GOOD: dict[str, Any] = {"model": "m", "input": "hi"}


def _with(**fields: Any) -> dict[str, Any]:
    return copy.deepcopy(GOOD) | fields


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_with(previous_response_id="resp_123"), "previous_response_id"),
        (_with(conversation="conv_1"), "conversation"),
        (_with(background=True), "background"),
        (_with(temperature=2.1), "temperature"),
        (_with(top_p=0), "top_p"),
        (_with(max_output_tokens=0), "max_output_tokens"),
        (_with(input=5), "input"),
        (_with(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
        (
            _with(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
            "input[0].content[0].type",
        ),
        (_with(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
        (
            _with(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]),
            "input[0].call_id",
        ),
        (_with(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]), "input[0].name"),
        (_with(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
        (_with(tools=[{"name": "untyped"}]), "tools[0].type"),
        (_with(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
        (_with(tool_choice="maybe"), "tool_choice"),
        (_with(tool_choice={"type": "function", "name": "ghost"}), "tool_choice.name"),
        (_with(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
        (_with(text={"format": {"type": "xml"}}), "text.format.type"),
        (_with(reasoning={"effort": "extreme"}), "reasoning.effort"),
    ],
)
def test_bad_values_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RecipeError) as caught:
        responses_to_conversation(body)
    assert caught.value.param == param


def test_previous_response_id_error_explains_statelessness() -> None:
    with pytest.raises(RecipeError, match="keeps no responses"):
        responses_to_conversation(_with(previous_response_id="resp_1", store=True))


# ---------------------------------------------------------------- outputs


def test_default_echo_matches_an_empty_request() -> None:
    assert response_echo(ResponsesRequest(input="")) == default_echo()


def test_body_validates_as_sdk_response() -> None:
    request = parse_responses_request({"input": "x", "tools": [WEATHER_TOOL], "max_output_tokens": 100})
    body = build_response(reasoning_text_tool_events(), **IDS, echo=response_echo(request))
    response = Response.model_validate(body)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "The user wants the weather."
    assert message.type == "message" and message.status == "completed"
    assert response.output_text == "Let me check that for you."
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_w1",
        "get_weather",
        WEATHER_TOOL_ARGS,
        "completed",
    )
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == 64
    assert response.usage.output_tokens_details.reasoning_tokens == 6
    assert response.usage.total_tokens == 150
    assert response.max_output_tokens == 100 and response.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert len({item.id for item in response.output}) == 3


def test_stream_accumulates_to_the_body() -> None:
    events = reasoning_text_tool_events()
    body = Response.model_validate(build_response(events, **IDS))
    seen = _accumulate(_encode(events))
    completed = seen[-1]
    assert completed.type == "response.completed"
    assert _plain(completed.response.output) == _plain(body.output)
    assert completed.response.usage == body.usage


def test_event_order_and_sequence_numbers_for_text() -> None:
    payloads = _events(_encode(text_events()))
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [p for p in payloads if p["type"] == "response.output_text.delta"]
    assert {(p["output_index"], p["content_index"], p["item_id"]) for p in deltas} == {(0, 0, "msg_test1_0")}
    assert payloads[0]["response"]["status"] == "in_progress" and payloads[0]["response"]["output"] == []


def test_reasoning_item_streams_reasoning_text_events() -> None:
    payloads = _events(_encode(reasoning_text_tool_events()))
    kinds = [p["type"] for p in payloads]
    first_item = kinds.index("response.output_item.added")
    assert kinds[first_item : first_item + 7] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    call_events = [p for p in payloads if p["type"].startswith("response.function_call_arguments")]
    assert "".join(p["delta"] for p in call_events[:-1]) == WEATHER_TOOL_ARGS
    assert call_events[-1]["arguments"] == WEATHER_TOOL_ARGS
    assert {p["output_index"] for p in call_events} == {2}


def test_max_tokens_gives_incomplete_and_a_cut_call_is_not_completed() -> None:
    events = [
        TextDelta("Calling"),
        ToolCallStart(0, "call_9", "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Pa'),
        Finish("length"),
        Usage(20, 16),
    ]
    body = Response.model_validate(build_response(events, **IDS))
    assert body.status == "incomplete"
    assert body.incomplete_details is not None and body.incomplete_details.reason == "max_output_tokens"
    assert body.output[1].type == "function_call" and body.output[1].status == "incomplete"
    payloads = _events(_encode(events))
    assert payloads[-1]["type"] == "response.incomplete"
    assert not any(p["type"] == "response.function_call_arguments.done" for p in payloads)
    seen = _accumulate(_encode(events))
    assert seen[-1].type == "response.incomplete"
    assert seen[-1].response.output[1].status == "incomplete"


def test_cut_call_whose_text_comes_back_as_text() -> None:
    """The parser turns an unfinished call's block back into text: the call item is closed as
    incomplete before the message item opens, and the response is still incomplete."""
    events = [
        ToolCallStart(0, "call_9", "get_weather"),
        ToolCallArgsDelta(0, '{"ci'),
        TextDelta('<tool_call>{"ci'),
        Finish("length"),
        Usage(20, 16),
    ]
    payloads = _events(_encode(events))
    done_items = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done_items] == [
        ("function_call", "incomplete"),
        ("message", "incomplete"),
    ]
    seen = _accumulate(_encode(events))
    assert seen[-1].type == "response.incomplete"
    body = Response.model_validate(build_response(events, **IDS))
    assert body.output_text == '<tool_call>{"ci'


def test_logprobs_ride_on_text_deltas() -> None:
    payloads = _events(_encode(text_events(logprobs=True)))
    deltas = [p for p in payloads if p["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in p["logprobs"]] for p in deltas] == [[], ["Hello"], [" there"]]
    done = next(p for p in payloads if p["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == ["Hello", " there", ", friend!"]
    body = Response.model_validate(build_response(text_events(logprobs=True), **IDS))
    message = body.output[0]
    assert message.type == "message" and message.content[0].type == "output_text"
    assert message.content[0].logprobs is not None and len(message.content[0].logprobs) == 3


def test_failure_emits_response_failed() -> None:
    events = [ReasoningDelta("x"), Finish("error", message="out of memory")]
    with pytest.raises(GenerationError):
        build_response(events, **IDS)
    payloads = _events(_encode(events))
    assert payloads[-1]["type"] == "response.failed"
    failed = Response.model_validate(payloads[-1]["response"])
    assert failed.status == "failed" and failed.error is not None and failed.error.message == "out of memory"


def test_real_client_end_to_end() -> None:
    def reply(body: dict[str, Any]) -> Any:
        request = parse_responses_request(body)
        conversation = request_to_conversation(request)
        assert conversation.tools[0].name == "get_weather"
        echo = response_echo(request)
        if not conversation.stream:
            return json_response(build_response(reasoning_text_tool_events(), **IDS, echo=echo))
        return sse_response(_encode(reasoning_text_tool_events(), echo=echo))

    client = openai_client(Recorder(reply))
    request: dict[str, Any] = {"model": "smol", "input": "Weather in Paris?", "tools": [WEATHER_TOOL]}
    plain = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == plain.output_text == "Let me check that for you."
    assert _plain(final.output) == _plain(plain.output)
    assert final.usage == plain.usage
