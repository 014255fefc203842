"""DeepSeek-V3.1 and R1 renderers against their official chat templates."""

from __future__ import annotations

import copy

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from deepinfer.recipe import Recipe
from deepinfer.recipe.ir import Conversation, Message, Reasoning, TextPart, Thinking, Tool, ToolCall
from deepinfer.recipe.render.deepseek_v31 import (
    V31_CALL_SYNTAX,
    DeepSeekR1Renderer,
    DeepSeekV31Renderer,
    tools_section,
)
from tests.recipe.conftest import template
from tests.recipe.helpers import conversation_from_openai

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

TOOL_LOOP = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "b", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rainy"},
    {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
    {"role": "user", "content": "Thanks!"},
]


def hf_render(source: str, messages: list[dict], **kwargs) -> str:
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token=BOS,
        eos_token=EOS,
        unk_token="<unk>",
    )
    tok.chat_template = source
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("cut", [2, 5, 6, 7])
def test_v31_matches_official_template(thinking, cut):
    """Every prefix of a tool loop renders as the official V3.1 template does (transformers)."""
    messages = TOOL_LOOP[:cut]
    expected = hf_render(template("deepseek_v31.jinja"), messages, thinking=thinking)
    conv = conversation_from_openai(messages, thinking=thinking)
    assert DeepSeekV31Renderer().render(conv) == expected


def test_v31_tools_go_into_the_system_prompt():
    """The official template has no tool list; the V3.1 model card's section follows the system prompt."""
    tools = [Tool(name="weather", description="Get weather", parameters={"type": "object"})]
    conv = conversation_from_openai(TOOL_LOOP[:2])
    conv.tools = tools
    section = tools_section(tools, V31_CALL_SYNTAX)
    assert section.startswith("## Tools\nYou have access to the following tools:\n\n### weather\n")
    assert 'Description: Get weather\n\nParameters: {"type": "object"}\n\nIMPORTANT:' in section
    assert (
        "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}"
        in section
    )
    system = {"role": "system", "content": "You are helpful.\n\n" + section}
    expected = hf_render(template("deepseek_v31.jinja"), [system, TOOL_LOOP[1]])
    assert DeepSeekV31Renderer().render(conv) == expected


def test_v31_drops_earlier_reasoning():
    """V3.1 never renders the reasoning of earlier assistant turns."""
    conv = Conversation(
        messages=[
            Message(role="user", content=[TextPart("q")]),
            Message(role="assistant", content=[TextPart("a")], reasoning=[Reasoning("secret")]),
            Message(role="user", content=[TextPart("q2")]),
        ],
        thinking=Thinking(enabled=True),
    )
    text = DeepSeekV31Renderer().render(conv)
    assert "secret" not in text
    assert text == f"{BOS}<｜User｜>q<｜Assistant｜></think>a{EOS}<｜User｜>q2<｜Assistant｜><think>"


def r1_reference(messages: list[dict]) -> str:
    """The official R1 template, rendered directly (it needs content=None on tool-call turns,
    which transformers drops, so it cannot go through apply_chat_template)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template("deepseek_r1.jinja")).render(
        messages=messages, bos_token=BOS, add_generation_prompt=True
    )


@pytest.mark.parametrize("cut", [2, 5, 6, 7])
def test_r1_matches_official_template(cut):
    """Where the official R1 template is well formed (two calls, one result round), we agree."""
    messages = copy.deepcopy(TOOL_LOOP[:cut])
    conv = conversation_from_openai(messages)
    for m in messages:
        if m.get("tool_calls"):
            m["content"] = None
    assert DeepSeekR1Renderer().render(conv) == r1_reference(messages)


def test_r1_single_call_is_well_formed():
    """The official template forgets `<｜tool▁calls▁end｜>` after a single call; we do not."""
    conv = Conversation(
        messages=[
            Message(role="user", content=[TextPart("q")]),
            Message(role="assistant", tool_calls=[ToolCall(id="a", name="f", arguments='{"x": 1}')]),
            Message(role="tool", tool_call_id="a", content=[TextPart("r")]),
        ]
    )
    assert DeepSeekR1Renderer().render(conv) == (
        f"{BOS}<｜User｜>q<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
        f'```json\n{{"x": 1}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>{EOS}'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


def test_r1_prompt_starts_the_parser_in_reasoning():
    """R1's reply header ends with `<think>\\n`, so its parser starts inside the reasoning."""
    prompt = Recipe("deepseek_r1").render(conversation_from_openai(TOOL_LOOP[:2]))
    assert prompt.text.endswith("<｜Assistant｜><think>\n")
    done = prompt.parse_completion("Let me see.\n</think>\n\nHello!")
    assert (done.reasoning, done.content) == ("Let me see.", "Hello!")
