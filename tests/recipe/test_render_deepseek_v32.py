"""DeepSeek-V3.2 native encoding: the official fixture byte for byte, and the rules behind it."""

from __future__ import annotations

import json

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import (
    Conversation,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
)
from deepinfer.recipe.render.deepseek_v32 import DeepSeekV32Renderer
from tests.recipe.conftest import FIXTURES
from tests.recipe.helpers import conversation_from_openai

FIXTURE = FIXTURES / "deepseek_v32"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def user(text: str) -> Message:
    return Message(role="user", content=[TextPart(text)])


def test_official_fixture_byte_for_byte():
    """The fixture conversation (thinking mode, tools on the system message) renders exactly."""
    data = json.loads((FIXTURE / "test_input.json").read_text(encoding="utf-8"))
    conv = conversation_from_openai(data["messages"], data["tools"], thinking=True)
    expected = (FIXTURE / "test_output.txt").read_text(encoding="utf-8").strip()
    assert DeepSeekV32Renderer().render(conv) == expected


def test_chat_mode_closes_thinking_after_every_user_turn():
    """Chat mode: every user turn ends with `</think>` and assistant reasoning is never rendered."""
    conv = Conversation(
        messages=[
            Message(role="system", content=[TextPart("S")]),
            user("hello"),
            Message(role="assistant", content=[TextPart("Hi!")], reasoning=[Reasoning("hmm")]),
            user("1+1=?"),
        ],
        thinking=Thinking(enabled=False),
    )
    expected = f"{BOS}S<｜User｜>hello<｜Assistant｜></think>Hi!{EOS}<｜User｜>1+1=?<｜Assistant｜></think>"
    assert DeepSeekV32Renderer().render(conv) == expected


def test_reasoning_dropped_before_last_user_kept_after():
    """Thinking mode: reasoning of turns before the last user message is dropped; the current
    tool loop (after the last user message) keeps it."""
    conv = Conversation(
        messages=[
            user("q1"),
            Message(role="assistant", content=[TextPart("a1")], reasoning=[Reasoning("old thoughts")]),
            user("q2"),
            Message(
                role="assistant",
                reasoning=[Reasoning("new thoughts")],
                tool_calls=[ToolCall(id="c1", name="f", arguments='{"x": 1}')],
            ),
            Message(role="tool", tool_call_id="c1", content=[TextPart("42")]),
        ],
        tools=[Tool(name="f")],
        thinking=Thinking(enabled=True),
    )
    text = DeepSeekV32Renderer().render(conv)
    assert "old thoughts" not in text
    assert "<｜User｜>q1<｜Assistant｜></think>a1" + EOS in text
    assert "<｜User｜>q2<｜Assistant｜><think>new thoughts</think>\n\n<｜DSML｜function_calls>" in text
    assert '<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>' in text
    # After the results of the current loop the model thinks again.
    assert text.endswith("<function_results>\n<result>42</result>\n</function_results>\n\n<think>")


def test_tools_without_system_message_get_an_empty_one():
    """Tools need a system message to live in: an empty one is put first."""
    conv = Conversation(messages=[user("hi")], tools=[Tool(name="f", description="d")])
    text = DeepSeekV32Renderer().render(conv)
    assert text.startswith(BOS + "\n\n## Tools\n\nYou have access to a set of tools")
    assert (
        '<functions>\n{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}\n</functions>\n<｜User｜>hi'
        in text
    )


def test_response_format_section_follows_the_tools():
    """A JSON schema response format is described after the tool section of the system message."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    conv = Conversation(
        messages=[Message(role="system", content=[TextPart("S")]), user("hi")],
        response_format=ResponseFormat(type="json_schema", json_schema=schema, name="out"),
    )
    text = DeepSeekV32Renderer().render(conv)
    assert text == (
        f"{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + json.dumps({"type": "json_schema", "json_schema": {"name": "out", "schema": schema}})
        + "<｜User｜>hi<｜Assistant｜></think>"
    )


def test_developer_message_is_a_user_turn():
    """The developer role renders as a user turn announcing the user's message (official encoder)."""
    conv = Conversation(
        messages=[Message(role="developer", content=[TextPart("do X")])], thinking=Thinking(enabled=True)
    )
    assert DeepSeekV32Renderer().render(conv) == (
        f"{BOS}<｜User｜>\n\n# The user's message is: do X<｜Assistant｜><think>"
    )
    with pytest.raises(RecipeError) as err:
        DeepSeekV32Renderer().render(Conversation(messages=[Message(role="developer")]))
    assert err.value.param == "messages[0].content"


def test_parameterless_call_and_non_string_values():
    """Strings go verbatim with string="true"; other JSON values as JSON; no parameters → empty body."""
    conv = Conversation(
        messages=[
            user("go"),
            Message(
                role="assistant",
                tool_calls=[
                    ToolCall(id="a", name="now", arguments=""),
                    ToolCall(
                        id="b", name="f", arguments='{"s": "ü \\"q\\"", "n": [1, {"k": null}], "t": true}'
                    ),
                ],
            ),
        ]
    )
    text = DeepSeekV32Renderer().render(conv)
    assert '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>' in text
    assert '<｜DSML｜parameter name="s" string="true">ü "q"</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="n" string="false">[1, {"k": null}]</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="t" string="false">true</｜DSML｜parameter>' in text


def test_recipe_prompt_state_follows_thinking_mode():
    """The parser made for a thinking prompt starts in reasoning; for a chat prompt, in content."""
    recipe = Recipe("deepseek_v32")
    thinking = recipe.render(Conversation(messages=[user("hi")], thinking=Thinking(enabled=True)))
    chat = recipe.render(Conversation(messages=[user("hi")]))
    assert thinking.parser_spec.initial == "reasoning"
    assert chat.parser_spec.initial == "content"
    assert thinking.parse_completion("ponder</think>Hello").reasoning == "ponder"
    assert chat.parse_completion("Hello").content == "Hello"
