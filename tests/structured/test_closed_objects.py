"""Strict object schemas by default: an object schema that declares `properties` but not
`additionalProperties` allows no other key (OpenAI's strict semantics), as the server applies it
to response formats and forced calls (`--json-schema-additional-properties`)."""

from __future__ import annotations

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.ir import Conversation, Message, ResponseFormat, TextPart, Tool, ToolChoice
from deepinfer.recipe.model_info import ModelInfo
from deepinfer.server.constraints import CHAT_FORMAT, output_constraint
from deepinfer.structured.json_schema import closed_objects
from deepinfer.structured.spec import GrammarSpec

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
CLOSED = {**PERSON, "additionalProperties": False}


def test_every_object_that_declares_properties_is_closed() -> None:
    schema = {
        "type": "object",
        "properties": {
            "who": PERSON,
            "list": {"type": "array", "items": {"type": "object", "properties": {}}},
            "either": {"anyOf": [PERSON, {"type": "null"}]},
            "tuple": {"type": "array", "prefixItems": [PERSON]},
            "ref": {"$ref": "#/$defs/P"},
        },
        "$defs": {"P": PERSON},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["who"] == CLOSED
    assert props["list"]["items"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert props["either"]["anyOf"] == [CLOSED, {"type": "null"}]
    assert props["tuple"]["prefixItems"] == [CLOSED]
    assert props["ref"] == {"$ref": "#/$defs/P"} and closed["$defs"]["P"] == CLOSED
    assert schema["properties"]["who"] == PERSON  # the client's schema is not changed


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # declares no properties: any object, as json_object
        {**PERSON, "additionalProperties": True},
        {**PERSON, "additionalProperties": {"type": "integer"}},
        {**PERSON, "patternProperties": {"^x": {}}},
        {**PERSON, "unevaluatedProperties": False},
        {"type": "string", "enum": ["a"], "default": {"properties": {}}},  # values, not schemas
    ],
)
def test_schemas_that_decide_their_other_keys_are_left_alone(schema: dict) -> None:
    assert closed_objects(schema) == schema


def test_all_of_branches_stay_open() -> None:
    """Closing each branch would exclude the other branch's keys: nothing would validate."""
    other = {"type": "object", "properties": {"age": {"type": "integer"}}}
    schema = {"allOf": [PERSON, other]}
    assert closed_objects(schema) == schema


@pytest.mark.parametrize(("schema", "extra_allowed"), [(PERSON, True), (closed_objects(PERSON), False)])
def test_llguidance_enforces_the_closed_schema(
    backend, hf_tokenizer, schema: dict, extra_allowed: bool
) -> None:
    """What the engine compiles: open, llguidance lets the model add keys; closed, it cannot."""
    matcher = backend.compile(GrammarSpec.json(schema)).new_matcher()
    tokens = hf_tokenizer.encode('{"name": "Ann", "age": 3}', add_special_tokens=False)
    assert (matcher.validate_tokens(tokens) == len(tokens)) is extra_allowed
    matcher = backend.compile(GrammarSpec.json(schema)).new_matcher()
    tokens = hf_tokenizer.encode('{"name": "Ann"}', add_special_tokens=False)
    assert matcher.validate_tokens(tokens) == len(tokens)


def test_the_server_closes_formats_and_forced_calls_unless_allowed(hf_tokenizer) -> None:
    """Response formats and forced-call arguments (every API goes through `output_constraint`):
    closed by default, the client's own schema with `allow`."""
    info = ModelInfo(chat_template=hf_tokenizer.chat_template)
    recipe = Recipe.for_model(info)
    ask = [Message(role="user", content=[TextPart("hi")])]
    fmt = Conversation(messages=ask, response_format=ResponseFormat(type="json_schema", json_schema=PERSON))
    forced = Conversation(
        messages=ask,
        tools=[Tool(name="save", parameters=PERSON)],
        tool_choice=ToolChoice(mode="named", name="save"),
    )
    for conv in (fmt, forced):
        prompt = recipe.render(conv, tokenizer=hf_tokenizer.backend_tokenizer)
        specs = {
            policy: output_constraint(
                conv,
                prompt,
                CHAT_FORMAT,
                parallel_calls=False,
                special_tokens=frozenset(),
                additional_properties=policy,
            )
            for policy in ("forbid", "allow")
        }
        strict, loose = specs["forbid"], specs["allow"]
        assert strict is not None and loose is not None
        if conv is fmt:
            assert strict.schema == CLOSED and loose.schema == PERSON
        else:
            assert '"additionalProperties": false' in (strict.text or "")
            assert "additionalProperties" not in (loose.text or "")
