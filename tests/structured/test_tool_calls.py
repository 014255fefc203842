"""Forced tool calls: random walks over the real tokenizer's masks always give a well-formed call
in the model's syntax whose arguments validate against the tool's schema."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from deepinfer.recipe.ir import Tool
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.structured.llguidance_backend import LLGuidanceGrammar
from deepinfer.structured.tool_calls import tool_call_spec
from tests.structured.validation import strict_validator
from tests.structured.walk import random_walk

TOOLS = [
    Tool(
        "get_weather",
        parameters={
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "a city"},
                "date": {"type": "string", "format": "date"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["location", "date"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "get_datetime",
        parameters={
            "type": "object",
            "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "create_event",
        parameters={
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 20},
                "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2},
                "slot": {
                    "type": "object",
                    "properties": {
                        "start": {"type": "string", "format": "time"},
                        "minutes": {"type": "integer", "minimum": 15},
                    },
                    "required": ["start", "minutes"],
                    "additionalProperties": False,
                },
                "private": {"type": "boolean"},
                "code": {"type": "string", "format": "uuid"},
            },
            "required": ["title", "slot"],
            "additionalProperties": False,
        },
    ),
    Tool("ping", parameters={"type": "object", "properties": {}, "additionalProperties": False}),
]
SCHEMAS = {t.name: t.parameters for t in TOOLS}

DSML = "｜DSML｜"
CLOSERS = {
    "hermes": ('"', "}", "]", "\n</tool_call>"),
    "dsml": ('"', "}", "]", f"</{DSML}parameter>", f"</{DSML}invoke>", f"</{DSML}function_calls>"),
}


def parse_hermes(text: str) -> list[tuple[str, dict]]:
    blocks = list(re.finditer(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S))
    assert blocks and "\n".join(m.group(0) for m in blocks) == text, f"not Hermes blocks: {text!r}"
    calls = []
    for m in blocks:
        obj = json.loads(m.group(1))
        assert list(obj) == ["name", "arguments"], obj
        assert isinstance(obj["arguments"], dict)
        calls.append((obj["name"], obj["arguments"]))
    return calls


_INVOKE_HEAD = re.compile(rf'<{DSML}invoke name="([^"<>\n]+)">\n')
_PARAM_HEAD = re.compile(rf'<{DSML}parameter name="([^"<>\n]+)" string="(true|false)">')


def parse_dsml(text: str) -> list[tuple[str, dict]]:
    """A strict sequential reader: a value runs to the first closing parameter tag."""
    body = re.fullmatch(rf"\n{{0,2}}<{DSML}function_calls>\n(.*)</{DSML}function_calls>", text, re.S)
    assert body, f"not a DSML block: {text!r}"
    rest, calls = body.group(1), []
    while rest:
        head = _INVOKE_HEAD.match(rest)
        assert head, f"expected an invoke in {text!r}"
        rest, args = rest[head.end() :], {}
        while param := _PARAM_HEAD.match(rest):
            key, is_string = param.groups()
            value, sep, rest = rest[param.end() :].partition(f"</{DSML}parameter>\n")
            assert sep and key not in args, f"bad parameter {key!r} in {text!r}"
            args[key] = value if is_string == "true" else json.loads(value)
        assert rest.startswith(f"</{DSML}invoke>\n"), f"expected the invoke's end in {text!r}"
        rest = rest[len(f"</{DSML}invoke>\n") :]
        calls.append((head.group(1), args))
    assert calls
    return calls


def recipe_parse(fmt: str, text: str) -> list[tuple[str, dict]]:
    """The recipe's own streaming parser, fed token-sized pieces, must read the same calls."""
    from deepinfer.recipe.parse.result import CompletionBuilder
    from deepinfer.recipe.parse.stream import ParserSpec, StreamParser

    family = "deepseek_v32" if fmt == "dsml" else "chat_template"
    parser = StreamParser(ParserSpec(family=family, tool_format=fmt, tool_names=tuple(SCHEMAS)))
    builder = CompletionBuilder()
    for i in range(0, len(text), 3):
        builder.extend(parser.feed(text[i : i + 3]))
    builder.extend(parser.finish("stop"))
    result = builder.result()
    assert result.content.strip() == "", f"text outside calls: {result.content!r}"
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


PARSERS = {"hermes": parse_hermes, "dsml": parse_dsml}


@pytest.mark.parametrize("fmt", ["hermes", "dsml"])
@pytest.mark.parametrize("named", [None, "get_weather", "create_event", "ping"])
def test_forced_calls_are_valid(backend, hf_tokenizer, tokenizer_info, fmt, named):
    spec = tool_call_spec(TOOLS, fmt, name=named, special_tokens=tokenizer_info.special_tokens)
    grammar = backend.compile(spec)
    assert isinstance(grammar, LLGuidanceGrammar), grammar
    rng = np.random.default_rng(len(fmt) * 100 + len(named or ""))
    names_seen = set()
    for _ in range(6):
        walk = random_walk(
            grammar.new_matcher(),
            hf_tokenizer,
            tokenizer_info.vocab_size,
            tokenizer_info.eos_token_ids,
            rng,
            closers=CLOSERS[fmt],
        )
        text = hf_tokenizer.decode(walk.token_ids)
        calls = PARSERS[fmt](text)
        if named:
            assert len(calls) == 1 and calls[0][0] == named
        for name, args in calls:
            names_seen.add(name)
            errors = [e.message for e in strict_validator(SCHEMAS[name]).iter_errors(args)]
            assert not errors, f"{name}{args} from {text!r}: {errors}"
        assert recipe_parse(fmt, text) == calls
    if named is None:
        assert len(names_seen) >= 2  # the walk reaches several tools


def test_fixture_call_is_accepted(backend, hf_tokenizer):
    """The exact call text of the official DeepSeek-V3.2 fixture is in the DSML grammar."""
    tools = [
        Tool(
            "get_weather",
            parameters={
                "type": "object",
                "properties": {"location": {"type": "string"}, "date": {"type": "string"}},
                "required": ["location", "date"],
            },
        )
    ]
    text = (
        "\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">San Francisco</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="date" string="true">2024-01-16</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">New York</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="date" string="true">2024-01-16</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜function_calls>"
    )
    matcher = backend.compile(tool_call_spec(tools, "dsml")).new_matcher()
    for token in hf_tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token), matcher.error
    assert matcher.accept_token(hf_tokenizer.eos_token_id)
    named_once = backend.compile(tool_call_spec(tools, "dsml", name="get_weather")).new_matcher()
    two_calls = hf_tokenizer.encode(text, add_special_tokens=False)
    assert named_once.validate_tokens(two_calls) < len(two_calls)  # a named choice makes one call


def test_bad_tool_choices():
    with pytest.raises(InvalidRequestError, match="not among"):
        tool_call_spec(TOOLS, "hermes", name="nope")
    with pytest.raises(InvalidRequestError, match="no tools"):
        tool_call_spec([], "dsml")
    with pytest.raises(InvalidRequestError, match="cannot appear"):
        tool_call_spec([Tool('bad"name')], "hermes")


def test_unsupported_argument_schema_is_refused(backend):
    tools = [
        Tool(
            "f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}, "if": {}, "then": {}}
        )
    ]
    outcome = backend.compile(tool_call_spec(tools, "hermes"))
    assert not isinstance(outcome, LLGuidanceGrammar)
    assert outcome.kind == "unsupported" and "'if'" in outcome.message and outcome.param == "tools"
