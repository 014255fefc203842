"""Streaming parser edge cases; each docstring states the expected behaviour."""

from __future__ import annotations

import re

import pytest

from deepinfer.recipe import Recipe, RecipeError
from deepinfer.recipe.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from deepinfer.recipe.ir import Conversation, Message, TextPart, Thinking, Tool, ToolChoice
from deepinfer.recipe.parse import CompletionBuilder, ParserSpec, StreamParser, new_call_id
from tests.recipe.conftest import counting_ids, template
from tests.recipe.samples import LLAMA, QWEN3, R1, SMOL, V31, V32

D = "｜DSML｜"


def kinds(events) -> list[str]:
    return [type(e).__name__ for e in events]


def parse(spec: ParserSpec, chunks: list[str], reason: str = "stop"):
    parser = StreamParser(spec, id_factory=counting_ids())
    builder = CompletionBuilder()
    for chunk in chunks:
        builder.extend(parser.feed(chunk))
    builder.extend(parser.finish(reason))  # type: ignore[arg-type]
    return builder.result()


def test_think_end_and_tool_call_in_one_chunk():
    """`</think>` and a whole DSML call in one piece: the reasoning ends, then the call starts,
    streams `{}` and ends, all from that single feed and in that order."""
    parser = StreamParser(V32, id_factory=counting_ids())
    assert parser.feed("Need the time") == [ReasoningDelta("Need the time")]
    events = parser.feed(
        f'.</think>\n\n<{D}function_calls>\n<{D}invoke name="get_time">\n</{D}invoke>\n</{D}function_calls>'
    )
    assert events == [
        ReasoningDelta("."),
        ToolCallStart(0, "call_0", "get_time"),
        ToolCallArgsDelta(0, "{}"),
        ToolCallEnd(0, "{}"),
    ]
    assert parser.finish("stop") == [Finish("tool_calls")]


@pytest.mark.parametrize(
    ("spec", "block", "arguments"),
    [
        (SMOL, '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', '{"q": "x"}'),
        (
            V31,
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "x"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            '{"q": "x"}',
        ),
        (
            R1,
            '</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"q": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            '{"q": "x"}',
        ),
        (LLAMA, '{"name": "search", "parameters": {"q": "x"}}', '{"q": "x"}'),
    ],
    ids=["hermes", "v31", "r1", "llama"],
)
def test_call_whose_begin_and_end_arrive_together(spec, block, arguments):
    """A call that arrives in one piece yields Start, its deltas and End in that one feed."""
    parser = StreamParser(spec, id_factory=counting_ids())
    events = [e for e in parser.feed(block) if not isinstance(e, (TextDelta, ReasoningDelta))]
    assert kinds(events)[0] == "ToolCallStart" and kinds(events)[-1] == "ToolCallEnd"
    assert "".join(e.delta for e in events if isinstance(e, ToolCallArgsDelta)) == arguments
    assert events[-1] == ToolCallEnd(0, arguments)
    assert parser.finish("stop")[-1] == Finish("tool_calls")


@pytest.mark.parametrize(
    ("spec", "cut_output"),
    [
        (
            V32,
            f'ok</think>\n\n<{D}function_calls>\n<{D}invoke name="search">\n<{D}parameter name="q" string="true">hal',
        ),
        (V31, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "hal'),
        (
            R1,
            '</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"q": "hal',
        ),
        (QWEN3, '<tool_call>\n{"name": "search", "arguments": {"q": "hal'),
        (LLAMA, '{"name": "search", "parameters": {"q": "hal'),
    ],
    ids=["dsml", "v31", "r1", "hermes", "llama"],
)
def test_max_tokens_inside_a_tool_call(spec, cut_output):
    """Hitting max_tokens mid-call: the call never ends, its markup is dropped (neither a call
    nor answer text), and the finish reason stays `length` (never `tool_calls`). DSML is
    stricter still: a call is only announced once whole."""
    parser = StreamParser(spec, id_factory=counting_ids())
    events = parser.feed(cut_output) + parser.finish("length")
    assert any(isinstance(e, ToolCallStart) for e in events) == (spec.tool_format != "dsml")
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert events[-1] == Finish("length")
    builder = CompletionBuilder()
    builder.extend(events)
    result = builder.result()
    assert result.tool_calls == [] and result.finish_reason == "length"
    assert result.content == ""


@pytest.mark.parametrize("tail", ["", "\n", "\n</tool_", "\n</tool_call"])
def test_max_tokens_in_the_close_tag_of_a_whole_call(tail):
    """The call's object is whole and max_tokens cuts its close tag: the call stands and no piece
    of the tag reaches the content (the default model ended a forced call so: `</tool_` as text)."""
    result = parse(QWEN3, ['<tool_call>\n{"name": "search", "arguments": {"q": "x"}}' + tail], "length")
    assert [call.arguments for call in result.tool_calls] == ['{"q": "x"}']
    assert result.content == ""


def test_malformed_block_falls_back_to_text():
    """A block that breaks its format is returned verbatim as text, the finish reason is `stop`,
    and tool syntax after it is text too."""
    text = 'Hi.\n<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call> then <tool_call>'
    result = parse(QWEN3, [text])
    assert result.content == text and result.tool_calls == [] and result.finish_reason == "stop"


def test_malformed_dsml_never_reaches_the_content():
    """Malformed DSML is dropped with what follows it: neither a call nor answer text."""
    text = f'Hi.\n\n<{D}function_calls>\n<{D}oops name="x">\n</{D}function_calls> then <{D}function_calls>'
    result = parse(V32, ["</think>", text])
    assert result.content == "Hi." and result.tool_calls == [] and result.finish_reason == "stop"


def test_end_of_turn_marker_ends_the_stream():
    """Text after the end-of-sentence marker is ignored, even when the marker is split."""
    result = parse(V31, ["Done.<｜end▁of▁", "sentence｜>garbage", " more"])
    assert result.content == "Done."


def test_marker_prefix_held_back_and_released():
    """Only a possible marker prefix is held: `<` waits for the next piece, ordinary text does not."""
    parser = StreamParser(SMOL)
    assert parser.feed("a<") == [TextDelta("a")]
    assert parser.feed("b") == [TextDelta("<b")]
    assert parser.feed("c <tool_") == [TextDelta("c")]
    assert parser.feed("cal") == []
    assert parser.feed("X") == [TextDelta(" <tool_calX")]


def test_no_tools_offered_means_tool_syntax_is_text():
    """Without tools (or with tool_choice none) the parser reads tool syntax as text."""
    recipe = Recipe("chat_template", chat_template=template("qwen3.jinja"))
    user = Message(role="user", content=[TextPart("hi")])
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for conv in (
        Conversation(messages=[user]),
        Conversation(messages=[user], tools=[Tool("f")], tool_choice=ToolChoice("none")),
    ):
        prompt = recipe.render(conv)
        assert prompt.parser_spec.tool_format is None
        assert prompt.parse_completion(call).content == call
    with_tools = recipe.render(Conversation(messages=[user], tools=[Tool("f")]))
    assert with_tools.parse_completion(call).tool_calls[0].name == "f"


def test_v32_prompt_is_never_paired_with_a_v31_parser():
    """A V3.2 prompt's parser reads DSML only; a V3.1 recipe refuses a V3.2 prompt; and a V3.2
    parser spec with the V3.1 syntax cannot even be built."""
    conv = Conversation(messages=[Message(role="user", content=[TextPart("hi")])], tools=[Tool("f")])
    v32_prompt = Recipe("deepseek_v32").render(conv)
    assert v32_prompt.parser_spec.tool_format == "dsml"
    with pytest.raises(RecipeError) as err:
        Recipe("deepseek_v31").new_parser(v32_prompt)
    assert err.value.param == "family"
    with pytest.raises(RecipeError):
        ParserSpec(family="deepseek_v32", tool_format="deepseek_v31")
    v31_call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    parsed = v32_prompt.parse_completion(v31_call)
    assert parsed.tool_calls == [] and parsed.content == v31_call
    assert Recipe("deepseek_v32").new_parser(v32_prompt).spec is v32_prompt.parser_spec


def test_initial_state_comes_from_the_prompt_tail(smollm2):
    """A prompt ending in `<think>` starts in reasoning; one ending in `</think>` in content;
    a template that can think but leaves it open lets the model open `<think>` itself; a
    template without thinking never parses `<think>`."""
    user = [Message(role="user", content=[TextPart("hi")])]
    assert Recipe("deepseek_r1").render(Conversation(messages=user)).parser_spec.initial == "reasoning"
    v31 = Recipe("deepseek_v31")
    assert (
        v31.render(Conversation(messages=user, thinking=Thinking(enabled=True))).parser_spec.initial
        == "reasoning"
    )
    assert (
        v31.render(Conversation(messages=user, thinking=Thinking(enabled=False))).parser_spec.initial
        == "content"
    )
    qwen3 = Recipe("chat_template", chat_template=template("qwen3.jinja"))
    assert qwen3.render(Conversation(messages=user)).parser_spec.initial == "maybe_reasoning"
    smol = Recipe.for_model(smollm2[0]).render(Conversation(messages=user))
    assert smol.parser_spec.initial == "content"
    assert smol.parse_completion("<think>not reasoning</think>").content == "<think>not reasoning</think>"


def test_string_encoded_arguments_are_decoded_once():
    """Arguments sent as a JSON string holding the object become that object text, not a string."""
    result = parse(SMOL, ['<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>'])
    assert result.tool_calls[0].arguments == '{"q": 1}'


def test_call_ids_are_injectable_and_openai_shaped_by_default():
    """Ids come from the given factory; the default is `call_` plus 24 letters and digits."""
    block = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    ids = iter(["first", "second"])
    parser = StreamParser(SMOL, id_factory=lambda: next(ids))
    starts = [e for e in parser.feed(block) if isinstance(e, ToolCallStart)]
    assert [s.id for s in starts] == ["first", "second"]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())
    assert new_call_id() != new_call_id()


def test_reasoning_tokens_are_counted_from_the_pieces():
    """Pieces fed while reasoning (including the one closing it) count as reasoning tokens, and
    `in_reasoning` tells the engine (e.g. for a thinking budget) where the stream is."""
    parser = StreamParser(R1)
    parser.feed("Hmm", [11])
    parser.feed(" ok", [12])
    assert parser.in_reasoning
    parser.feed("</think>", [13])
    assert not parser.in_reasoning
    parser.feed("Answer", [14])
    parser.finish("stop")
    assert parser.reasoning_tokens == 3


def test_feed_after_finish_is_an_error():
    """A finished parser takes no more text."""
    parser = StreamParser(SMOL)
    parser.finish("stop")
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_reasoning_cut_by_length_is_kept():
    """Output that ends inside the reasoning keeps all of it (trailing whitespace trimmed)."""
    result = parse(R1, ["Still thinking about", " it\n"], reason="length")
    assert (result.reasoning, result.content, result.finish_reason) == (
        "Still thinking about it",
        "",
        "length",
    )
