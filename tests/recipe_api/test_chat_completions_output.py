"""Canonical events -> `chat.completion` bodies and chunk streams, checked with the OpenAI SDK."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deepinfer.recipe.api import GenerationError
from deepinfer.recipe.api.chat_completions import chat_completion_to_conversation
from deepinfer.recipe.api.chat_completions_encoder import ChatCompletionEncoder, build_chat_completion
from deepinfer.recipe.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
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

IDS = {"completion_id": "chatcmpl-test", "model": "smol", "created": 1_700_000_000}


def _stream(choices: list[list[Any]], *, include_usage: bool = False, interleave: bool = False) -> list[str]:
    encoder = ChatCompletionEncoder(**IDS, n=len(choices), include_usage=include_usage)
    frames = encoder.start()
    if interleave:
        longest = max(len(c) for c in choices)
        for step in range(longest):
            for index, events in enumerate(choices):
                if step < len(events):
                    frames += encoder.feed(events[step], index)
    else:
        for index, events in enumerate(choices):
            for event in events:
                frames += encoder.feed(event, index)
    return frames + encoder.close()


def _chunks(frames: list[str]) -> list[dict[str, Any]]:
    decoded = decode_sse(frames)
    assert decoded[-1] == (None, "[DONE]")
    return [json.loads(data) for _, data in decoded[:-1]]


def _accumulate(frames: list[str]) -> Any:
    """The SDK's accumulated completion. Its final parse refuses `length` choices on purpose,
    so for those the accumulated snapshot is what the client holds."""
    state = ChatCompletionStreamState()
    for chunk in _chunks(frames):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    snapshot = state.current_completion_snapshot
    if any(choice.finish_reason == "length" for choice in snapshot.choices):
        return snapshot
    return state.get_final_completion()


def test_body_validates_as_sdk_chat_completion() -> None:
    body = build_chat_completion([reasoning_text_tool_events()], **IDS)
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check that for you."
    assert choice.message.model_extra == {"reasoning_content": "The user wants the weather."}
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_w1",
        "get_weather",
        WEATHER_TOOL_ARGS,
    )
    assert completion.usage is not None
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (
        120,
        30,
        150,
    )
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 64
    assert completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 6


def test_stream_accumulates_to_the_same_message() -> None:
    events = reasoning_text_tool_events()
    body = ChatCompletion.model_validate(build_chat_completion([events], **IDS))
    streamed = _accumulate(_stream([events]))
    expected, got = body.choices[0], streamed.choices[0]
    assert got.finish_reason == expected.finish_reason == "tool_calls"
    assert got.message.content == expected.message.content
    assert got.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert got.message.tool_calls is not None and expected.message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c.id, c.function.name, c.function.arguments) for c in expected.message.tool_calls
    ]


def test_chunk_shapes_role_first_then_ids_on_first_tool_delta() -> None:
    chunks = _chunks(_stream([reasoning_text_tool_events()]))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert "usage" not in chunk  # only present when include_usage was asked for
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert tool_deltas[0] == {
        "index": 0,
        "id": "call_w1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in tool_deltas[1:]
    )
    assert "".join(d["function"]["arguments"] for d in tool_deltas) == WEATHER_TOOL_ARGS
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def test_include_usage_adds_a_final_usage_chunk_and_null_usage_elsewhere() -> None:
    chunks = _chunks(_stream([text_events()], include_usage=True))
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 10 and last["usage"]["completion_tokens"] == 3
    completion = _accumulate(_stream([text_events()], include_usage=True))
    assert completion.usage is not None and completion.usage.total_tokens == 13


def test_two_choices_interleaved() -> None:
    first = [TextDelta("Red "), TextDelta("apples"), Finish("stop"), Usage(8, 2)]
    second = [
        ReasoningDelta("hmm"),
        TextDelta("Green"),
        TextDelta(" pears"),
        TextDelta(" too"),
        Finish("length"),
        Usage(8, 4, cached_tokens=4),
    ]
    frames = _stream([first, second], include_usage=True, interleave=True)
    indexes = [c["choices"][0]["index"] for c in _chunks(frames) if c["choices"]]
    assert indexes[:2] == [0, 1]  # every choice opens with its role chunk, in order
    assert indexes[2:6] == [0, 1, 0, 1]  # then they interleave
    completion = _accumulate(frames)
    assert [c.message.content for c in completion.choices] == ["Red apples", "Green pears too"]
    assert [c.finish_reason for c in completion.choices] == ["stop", "length"]
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (8, 6)
    body = ChatCompletion.model_validate(build_chat_completion([first, second], **IDS))
    assert [c.message.content for c in body.choices] == ["Red apples", "Green pears too"]
    assert body.choices[1].message.model_extra == {"reasoning_content": "hmm"}


def test_tool_call_cut_by_max_tokens_is_not_a_tool_call() -> None:
    events = [
        TextDelta("Calling."),
        ToolCallStart(index=0, id="call_x", name="get_weather"),
        ToolCallArgsDelta(index=0, delta='{"city": "Pa'),
        Finish("length"),
        Usage(10, 16),
    ]
    body = ChatCompletion.model_validate(build_chat_completion([events], **IDS))
    assert body.choices[0].finish_reason == "length"
    assert body.choices[0].message.tool_calls is None
    assert body.choices[0].message.content == "Calling."
    streamed = _accumulate(_stream([events]))
    assert streamed.choices[0].finish_reason == "length"


def test_tool_call_without_deltas_sends_arguments_at_end() -> None:
    events = [ToolCallStart(0, "call_1", "f"), ToolCallEnd(0, '{"a": 1}'), Finish("stop"), Usage(3, 4)]
    completion = _accumulate(_stream([events]))
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.choices[0].message.tool_calls is not None
    assert completion.choices[0].message.tool_calls[0].function.arguments == '{"a": 1}'
    body = ChatCompletion.model_validate(build_chat_completion([events], **IDS))
    assert body.choices[0].message.content is None  # no text next to tool calls: null, as OpenAI


def test_logprobs_in_body_and_stream() -> None:
    events = text_events(logprobs=True)
    body = ChatCompletion.model_validate(build_chat_completion([events], **IDS))
    assert body.choices[0].logprobs is not None and body.choices[0].logprobs.content is not None
    tokens = [t.token for t in body.choices[0].logprobs.content]
    assert "".join(tokens) == "Hello there, friend!"
    assert body.choices[0].logprobs.content[1].top_logprobs[1].token == "x"
    assert body.choices[0].logprobs.content[0].bytes == list(b"Hello")
    streamed = _accumulate(_stream([events]))
    assert streamed.choices[0].logprobs is not None and streamed.choices[0].logprobs.content is not None
    assert [t.model_dump() for t in streamed.choices[0].logprobs.content] == [
        t.model_dump() for t in body.choices[0].logprobs.content
    ]


def test_failed_generation_raises_and_streams_an_error() -> None:
    events = [TextDelta("partial"), Finish("error", message="device lost")]
    with pytest.raises(GenerationError, match="device lost"):
        build_chat_completion([events], **IDS)
    decoded = decode_sse(_stream([events]))
    error = json.loads(decoded[-2][1])
    assert error["error"]["message"] == "device lost" and error["error"]["type"] == "server_error"


def test_real_client_end_to_end() -> None:
    """The SDK sends a request; our codec parses it, encodes events, and the SDK reads them back."""

    def reply(body: dict[str, Any]) -> Any:
        conversation = chat_completion_to_conversation(body)
        assert conversation.tools[0].name == "get_weather"
        if not conversation.stream:
            return json_response(build_chat_completion([reasoning_text_tool_events()], **IDS))
        encoder = ChatCompletionEncoder(
            **IDS, n=conversation.params.n, include_usage=conversation.include_usage
        )
        frames = encoder.start()
        for event in reasoning_text_tool_events():
            frames += encoder.feed(event)
        return sse_response(frames + encoder.close())

    client = openai_client(Recorder(reply))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    request: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
    }
    plain = client.chat.completions.create(**request)
    with client.chat.completions.stream(**request, stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert plain.choices[0].message.tool_calls is not None and final.choices[0].message.tool_calls is not None
    assert final.choices[0].message.tool_calls[0].function.arguments == WEATHER_TOOL_ARGS
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.usage is not None and plain.usage is not None
    assert final.usage.model_dump() == plain.usage.model_dump()

    raw = client.chat.completions.create(**request, stream=True)
    assert next(chunk.choices[0].delta.role for chunk in raw if chunk.choices) == "assistant"


def test_real_client_raises_on_a_failed_stream() -> None:
    failing = [TextDelta("x"), Finish("abort")]
    client = openai_client(Recorder(lambda body: sse_response(_stream([failing]))))
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(openai.APIError, match="aborted"):
        for _ in stream:
            pass
