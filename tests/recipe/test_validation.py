"""Conversation validation shared by every renderer: clear RecipeErrors naming the field."""

from __future__ import annotations

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, ImagePart, Message, TextPart, Tool, ToolCall, ToolChoice
from deepinfer.recipe.render.common import prepare_messages
from tests.recipe.conftest import template

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
RECIPES = {
    "deepseek_v32": Recipe("deepseek_v32"),
    "deepseek_v31": Recipe("deepseek_v31"),
    "deepseek_r1": Recipe("deepseek_r1"),
    "chatml": Recipe("chat_template", chat_template=CHATML),
    "qwen3": Recipe("chat_template", chat_template=template("qwen3.jinja")),
}


def text(role: str, body: str, **kw) -> Message:
    return Message(role=role, content=[TextPart(body)], **kw)


def calls(*ids: str) -> Message:
    return Message(
        role="assistant",
        tool_calls=[ToolCall(id=i, name=f"f_{i}", arguments=f'{{"id": "{i}"}}') for i in ids],
    )


def result(call_id: str | None, body: str) -> Message:
    return text("tool", body, tool_call_id=call_id)


BAD = [
    ("empty", Conversation(), "messages"),
    ("unknown role", Conversation(messages=[Message(role="robot")]), "messages[0].role"),  # type: ignore[arg-type]
    ("result without call", Conversation(messages=[text("user", "q"), result("x", "r")]), "messages[1]"),
    (
        "unknown call id",
        Conversation(messages=[text("user", "q"), calls("a"), result("zzz", "r")]),
        "messages[2].tool_call_id",
    ),
    (
        "two results for one call",
        Conversation(messages=[text("user", "q"), calls("a", "b"), result("a", "1"), result("a", "2")]),
        "messages[3].tool_call_id",
    ),
    (
        "missing result",
        Conversation(messages=[text("user", "q"), calls("a", "b"), result("a", "1"), text("user", "next")]),
        "messages[1].tool_calls",
    ),
    (
        "more results than calls",
        Conversation(messages=[text("user", "q"), calls("a"), result(None, "1"), result(None, "2")]),
        "messages[3]",
    ),
    (
        "calls on a user message",
        Conversation(messages=[Message(role="user", tool_calls=[ToolCall("a", "f", "{}")])]),
        "messages[0].tool_calls",
    ),
    (
        "arguments not JSON",
        Conversation(
            messages=[text("user", "q"), Message(role="assistant", tool_calls=[ToolCall("a", "f", "{oops")])]
        ),
        "messages[1].tool_calls[0].arguments",
    ),
    (
        "arguments not an object",
        Conversation(
            messages=[text("user", "q"), Message(role="assistant", tool_calls=[ToolCall("a", "f", "[1]")])]
        ),
        "messages[1].tool_calls[0].arguments",
    ),
    (
        "duplicate call ids",
        Conversation(
            messages=[
                text("user", "q"),
                Message(role="assistant", tool_calls=[ToolCall("a", "f", "{}"), ToolCall("a", "g", "{}")]),
            ]
        ),
        "messages[1].tool_calls[1].id",
    ),
    (
        "image",
        Conversation(messages=[Message(role="user", content=[ImagePart(url="http://x")])]),
        "messages[0].content[0]",
    ),
    (
        "duplicate tool names",
        Conversation(messages=[text("user", "q")], tools=[Tool("f"), Tool("f")]),
        "tools[1].name",
    ),
    (
        "named tool_choice unknown",
        Conversation(messages=[text("user", "q")], tools=[Tool("f")], tool_choice=ToolChoice("named", "g")),
        "tool_choice",
    ),
]


@pytest.mark.parametrize("family", list(RECIPES))
@pytest.mark.parametrize(("case", "conv", "param"), BAD, ids=[b[0] for b in BAD])
def test_invalid_conversations_raise_with_the_field(family, case, conv, param):
    """Every family rejects the same malformed conversations, naming the same field."""
    with pytest.raises(RecipeError) as err:
        RECIPES[family].render(conv)
    assert err.value.param == param, (case, str(err.value))


def test_tool_results_are_reordered_to_call_order():
    """Results that come back out of order are rendered in the order of the calls."""
    conv = Conversation(
        messages=[
            text("user", "q"),
            calls("a", "b", "c"),
            result("c", "R3"),
            result("a", "R1"),
            result("b", "R2"),
        ]
    )
    ordered = prepare_messages(conv)
    assert [m.text for m in ordered[2:]] == ["R1", "R2", "R3"]
    assert [m.name for m in ordered[2:]] == ["f_a", "f_b", "f_c"]  # names filled in from the calls
    for family, recipe in RECIPES.items():
        prompt = recipe.render(conv).text
        assert prompt.index("R1") < prompt.index("R2") < prompt.index("R3"), family


def test_results_without_ids_answer_calls_in_order():
    """A result without a tool_call_id answers the first call still unanswered."""
    conv = Conversation(messages=[text("user", "q"), calls("a", "b"), result("b", "RB"), result(None, "RA")])
    assert [m.tool_call_id for m in prepare_messages(conv)[2:]] == [None, "b"]
    assert [m.text for m in prepare_messages(conv)[2:]] == ["RA", "RB"]


def test_a_conversation_may_end_on_unanswered_calls():
    """Calls with no results at all at the very end are fine (nothing was answered yet)."""
    conv = Conversation(messages=[text("user", "q"), calls("a")])
    assert len(prepare_messages(conv)) == 2
