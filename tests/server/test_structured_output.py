"""Structured output through the real server and the real SDKs: Chat Completions `response_format`,
Responses `text.format`, Anthropic `output_config.format`; schemas the engine cannot enforce are
a 400 before anything streams, and a schema that compiles too long times out without stalling
other requests."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import GRAMMAR_COMPILE_TIMEOUT_S, MODEL
from tests.structured.schemas import PATHOLOGICAL
from tests.structured.validation import strict_validator

# Bounded everywhere, so a sampled answer always closes well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "pets"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, favorite color and pets."}]
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 96


def _valid(text: str | None, schema: dict) -> dict:
    value = json.loads(text or "")
    strict_validator(schema).validate(value)
    return value


def test_chat_json_schema_sampled(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=CHAT_FORMAT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=11,
        n=2,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        _valid(choice.message.content, PERSON)
    assert len({c.message.content for c in reply.choices}) > 1  # sampled, yet every one conforms


def test_chat_json_schema_streamed(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=CHAT_FORMAT,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    _valid(text, PERSON)


def test_chat_json_object(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object with the capital of France."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_responses_text_format(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL,
        input=ASK[0]["content"],
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=MAX_TOKENS,
        temperature=0.8,
    )
    assert response.status == "completed"
    _valid(response.output_text, PERSON)


def test_messages_output_config_format(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
            "temperature": 0.8,
        },
    )
    assert message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text"]
    _valid(message.content[0].text, PERSON)


# As pydantic writes a model (and instructor's JSON_SCHEMA mode sends it): no additionalProperties,
# and nothing required, so only the server's strict default keeps other keys out.
OPEN_PERSON = {
    "type": "object",
    "title": "Person",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
}


def test_schema_without_additional_properties_yields_no_extra_key(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """OpenAI's strict semantics by default (--json-schema-additional-properties forbid): the
    declared properties only, in every API; the answer closes instead of running to max_tokens."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_PERSON}}
    reply = oai.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=3
    )
    texts = [(c.finish_reason, c.message.content) for c in reply.choices]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": OPEN_PERSON}},
            "temperature": 1.0,
        },
    )
    texts.append(
        ("stop" if message.stop_reason == "end_turn" else message.stop_reason, message.content[0].text)
    )
    for finish, text in texts:
        assert finish == "stop", text
        assert set(json.loads(text or "")) <= set(OPEN_PERSON["properties"]), text


UNSUPPORTED = {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}


@pytest.mark.parametrize("stream", [False, True])
def test_unsupported_keyword_is_a_400_openai(oai: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED}},
            max_tokens=4,
            stream=stream,  # refused before the stream starts: a plain 400, not an SSE error
        )
    error = info.value.body
    assert info.value.status_code == 400 and isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"] == (
        "response_format.json_schema.schema: unsupported JSON Schema keyword 'dependentRequired'"
    )
    assert error["code"] == "grammar_unsupported"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(
            model=MODEL,
            input="x",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"not": {"type": "string"}}}},
            max_output_tokens=4,
        )
    assert info.value.body["param"] == "text.format.schema"  # type: ignore[index]
    assert "unsupported JSON Schema keyword 'not'" in info.value.body["message"]  # type: ignore[index]


def test_unsupported_keyword_is_a_400_anthropic(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=ASK,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}}},
        )
    assert info.value.status_code == 400
    assert info.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "output_config.format.schema: unsupported JSON Schema keyword 'dependentRequired'",
        },
    }


def test_format_and_forced_tool_call_is_a_400(oai: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[tool],
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=4,
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    assert "tool_choice" in info.value.body["message"]  # type: ignore[index]


def test_compile_timeout_is_a_400_while_another_request_streams(oai: openai.OpenAI, server) -> None:
    """The pathological schema needs seconds of compiling; the API side gives up after the
    server's --grammar-compile-timeout and answers 400, and meanwhile a streaming request keeps
    receiving tokens and the event loop keeps answering (the compile never holds it).

    Counts and order, not time windows: while the server waits for the compile, sequential
    /health round trips keep completing (a held loop would answer at most the one in flight
    before the 400), and the stream ends with every token whatever the machine's load."""
    arrivals: list[float] = []
    first = threading.Event()
    outcome: dict[str, object] = {}

    def consume() -> None:
        try:
            stream = oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
                max_tokens=48,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.monotonic())
                    first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome["finish"] = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    outcome["tokens"] = chunk.usage.completion_tokens
        except Exception as error:  # reported by the assertions below
            outcome["error"] = error
        finally:
            first.set()

    probes: list[float] = []
    stop_probing = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=120.0) as client:
            while not stop_probing.is_set():
                assert client.get("/health").status_code == 200
                probes.append(time.monotonic())

    streamer = threading.Thread(target=consume)
    streamer.start()
    assert first.wait(120), "the streaming request never produced a token"
    prober = threading.Thread(target=probe)
    sent = time.monotonic()
    prober.start()
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": PATHOLOGICAL}},
            max_tokens=4,
        )
    answered = time.monotonic()
    stop_probing.set()
    prober.join(120)
    streamer.join(180)
    assert not streamer.is_alive() and not prober.is_alive()

    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "grammar_timeout"
    assert error["param"] == "response_format.json_schema.schema"
    assert f"took longer than {GRAMMAR_COMPILE_TIMEOUT_S:g} s" in error["message"]
    assert answered - sent >= GRAMMAR_COMPILE_TIMEOUT_S
    answered_during_the_wait = sum(sent < t < answered for t in probes)
    assert answered_during_the_wait >= 3, (answered_during_the_wait, len(probes))
    assert "error" not in outcome, outcome
    assert outcome == {"finish": "length", "tokens": 48}
    assert len(arrivals) > 0

    # The timeout is remembered: the same schema in the same field fails at once from the cache.
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as again:
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": PATHOLOGICAL}},
            max_tokens=4,
        )
    assert again.value.body["code"] == "grammar_timeout"  # type: ignore[index]
    assert time.monotonic() - started < GRAMMAR_COMPILE_TIMEOUT_S


def test_compile_timeout_in_anthropic_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=ASK,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": PATHOLOGICAL}}},
        )
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "output_config.format.schema: compiling the constraint took longer than"
    )
