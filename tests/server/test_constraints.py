"""How a chat request's response format and tool_choice become one constraint (no model needed),
and the API-side validator's asynchronous check on the default model's real tokenizer."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from deepinfer.model.loader.source import converted_gguf_dir, default_model_path
from deepinfer.recipe import ParserSpec, RenderedPrompt
from deepinfer.recipe.ir import Conversation, ResponseFormat, Tool, ToolChoice
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.server.constraints import (
    CHAT_FORMAT,
    MESSAGES_FORMAT,
    GrammarValidator,
    output_constraint,
    parallel_calls_allowed,
)
from deepinfer.server.errors import ApiError
from deepinfer.structured import GrammarSpec
from deepinfer.tokenizer import Tokenizer
from tests.structured.schemas import PATHOLOGICAL, SUITE

WEATHER = Tool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
CLOCK = Tool("get_time", parameters={"type": "object", "properties": {}})
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _prompt(family: str = "chat_template", tool_format: str | None = "hermes", initial: str = "content"):
    spec = ParserSpec(family=family, tool_format=tool_format, initial=initial)  # type: ignore[arg-type]
    return RenderedPrompt(text="", family=family, parser_spec=spec)


def _conv(mode: str = "auto", name: str | None = None, response_format: ResponseFormat | None = None):
    return Conversation(
        tools=[WEATHER, CLOCK], tool_choice=ToolChoice(mode, name), response_format=response_format
    )  # type: ignore[arg-type]


def _constraint(conv: Conversation, prompt: RenderedPrompt, *, parallel: bool = True) -> GrammarSpec | None:
    return output_constraint(conv, prompt, CHAT_FORMAT, parallel_calls=parallel, special_tokens=frozenset())


def test_free_choices_stay_free() -> None:
    assert _constraint(_conv("auto"), _prompt()) is None
    assert _constraint(_conv("none"), _prompt(tool_format=None)) is None
    fmt = ResponseFormat(type="json_schema", json_schema=SCHEMA)
    spec = _constraint(_conv("auto", response_format=fmt), _prompt())
    assert spec is not None and spec.kind == "json" and spec.param == "response_format.json_schema.schema"


def test_forced_choices_are_tool_grammars() -> None:
    required = _constraint(_conv("required"), _prompt())
    assert required is not None and required.kind == "grammar" and required.param == "tools"
    assert "get_weather" in required.text and "get_time" in required.text
    assert 'block ("\\n" block)*' in required.text  # several calls allowed
    single = _constraint(_conv("required"), _prompt(), parallel=False)
    assert single is not None and 'block ("\\n" block)*' not in single.text
    named = _constraint(_conv("named", "get_time"), _prompt())
    assert named is not None and "get_time" in named.text and "get_weather" not in named.text
    dsml = _constraint(_conv("named", "get_weather"), _prompt("deepseek_v32", "dsml", "reasoning"))
    assert dsml is not None and "DSML" in dsml.text and dsml.after_reasoning == "</think>"
    assert _constraint(_conv("required"), _prompt()).after_reasoning is None  # type: ignore[union-attr]


def test_format_and_forced_call_conflict() -> None:
    conv = _conv("required", response_format=ResponseFormat(type="json_object"))
    with pytest.raises(InvalidRequestError) as info:
        _constraint(conv, _prompt())
    assert info.value.param == "response_format" and "tool_choice" in str(info.value)
    # A plain-text format is no constraint, so it combines with anything.
    assert _constraint(_conv("required", response_format=ResponseFormat(type="text")), _prompt()) is not None


def test_unforceable_tool_syntax_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        _constraint(_conv("required"), _prompt(tool_format="llama3_json"))
    assert info.value.param == "tool_choice" and "llama3_json" in str(info.value)


def test_parallel_flags_of_both_apis() -> None:
    assert parallel_calls_allowed({})
    assert parallel_calls_allowed({"parallel_tool_calls": True})
    assert not parallel_calls_allowed({"parallel_tool_calls": False})
    assert parallel_calls_allowed({"tool_choice": "required"})
    assert parallel_calls_allowed({"tool_choice": {"type": "any"}})
    assert not parallel_calls_allowed({"tool_choice": {"type": "any", "disable_parallel_tool_use": True}})


@pytest.fixture(scope="module")
def validator():
    tokenizer = Tokenizer.from_dir(converted_gguf_dir(default_model_path()))
    built = GrammarValidator.build(tokenizer, 49152, timeout_s=0.5)
    yield built
    built.close()


def test_check_answers_400_naming_the_field(validator: GrammarValidator) -> None:
    asyncio.run(validator.check(None))
    asyncio.run(validator.check(GrammarSpec.json(SUITE["event_record"])))
    bad = GrammarSpec.json({"type": "object", "if": {"required": ["a"]}}, param=MESSAGES_FORMAT.schema)
    with pytest.raises(ApiError) as info:
        asyncio.run(validator.check(bad))
    error = info.value
    assert error.status == 400 and error.param == "output_config.format.schema"
    assert error.code == "grammar_unsupported" and "'if'" in error.message


def test_check_never_blocks_the_event_loop(validator: GrammarValidator) -> None:
    """While a compile runs into its timeout, the loop keeps ticking (other requests stream)."""

    async def run() -> tuple[ApiError, list[float]]:
        ticks: list[float] = []
        stop = asyncio.Event()

        async def tick() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        try:
            with pytest.raises(ApiError) as info:
                await validator.check(GrammarSpec.json(PATHOLOGICAL, param=CHAT_FORMAT.schema))
        finally:
            stop.set()
            await ticker
        return info.value, ticks

    started = time.monotonic()
    error, ticks = asyncio.run(run())
    assert error.code == "grammar_timeout" and "took longer than 0.5 s" in error.message
    assert error.param == "response_format.json_schema.schema"
    assert time.monotonic() - started < 3.0
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) >= 10 and max(gaps) < 0.4, max(gaps)
