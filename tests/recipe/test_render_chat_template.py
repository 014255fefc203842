"""Chat-template rendering equals transformers' apply_chat_template on the same messages and tools."""

from __future__ import annotations

import copy
import json
from datetime import datetime

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from deepinfer.recipe import Recipe
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, Message, TextPart, ToolCall
from deepinfer.recipe.render.chat_template import ChatTemplateRenderer, TemplateFeatures
from tests.recipe.conftest import template
from tests.recipe.helpers import conversation_from_openai, with_dict_arguments

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — with unicode °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]

PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 👋 Ça va ?"},
    {"role": "assistant", "content": "Bien, merci."},
    {"role": "user", "content": "Count to 3."},
]

NO_SYSTEM = [
    {"role": "user", "content": "  spaced  "},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "again"},
]

TOOL_LOOP = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two calls needed.",
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": '{"temp": "18°C"}'},
    {"role": "tool", "tool_call_id": "b", "name": "get_time", "content": "12:00"},
]

SINGLE_CALL = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "sunny"},
]


def hf_tokenizer(source: str, tokenizer: Tokenizer | None = None, **special: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        **(special or {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    )
    tok.chat_template = source
    return tok


def both(source: str, messages: list[dict], tools=None, *, gen: bool = True, thinking: bool | None = None):
    """(ours, transformers') for the same messages and tools."""
    hf = hf_tokenizer(source)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf.apply_chat_template(
        with_dict_arguments(messages), tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    ours = ChatTemplateRenderer(source, hf.special_tokens_map).render(
        conversation_from_openai(messages, tools, thinking=thinking), add_generation_prompt=gen
    )
    return ours, expected


CASES = [
    ("plain", PLAIN, None, True, None),
    ("plain-no-gen", PLAIN, None, False, None),
    ("no-system", NO_SYSTEM, None, True, None),
    ("tools-first-turn", TOOL_LOOP[:2], TOOLS, True, None),
    ("tool-loop", TOOL_LOOP, TOOLS, True, None),
    (
        "tool-loop-answered",
        [*TOOL_LOOP, {"role": "assistant", "content": "18°C at noon."}],
        TOOLS,
        False,
        None,
    ),
]


@pytest.mark.parametrize(("name", "messages", "tools", "gen", "thinking"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("source", ["qwen2_5_instruct.jinja", "qwen3.jinja"])
def test_qwen_templates_match_transformers(source, name, messages, tools, gen, thinking):
    """Qwen2.5 and Qwen3 (native tools, reasoning) render exactly as transformers renders them."""
    ours, expected = both(template(source), messages, tools, gen=gen, thinking=thinking)
    assert ours == expected


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_enable_thinking_matches_transformers(thinking):
    """`enable_thinking` reaches the template like transformers' extra kwargs do."""
    ours, expected = both(template("qwen3.jinja"), PLAIN, None, thinking=thinking)
    assert ours == expected
    assert ours.endswith("<think>\n\n</think>\n\n") is (thinking is False)


@pytest.mark.parametrize("messages", [PLAIN, SINGLE_CALL], ids=["plain", "single-call"])
def test_llama31_template_matches_transformers(messages):
    """Llama-3.x's template (JSON tool calls, tools in the first user turn) matches transformers."""
    ours, expected = both(
        template("llama3_3_instruct.jinja"), messages, TOOLS if messages is SINGLE_CALL else None
    )
    assert ours == expected
    if messages is SINGLE_CALL:
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in ours


@pytest.mark.parametrize("source", ["qwen2_5_instruct.jinja", "llama3_3_instruct.jinja"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_system_entries_among_turns_join_the_system_prompt(source, system):
    """System entries a client placed among the turns (Anthropic Messages, Claude Code's
    environment block) are appended, in order, to the system prompt (opened if there is none):
    templates read a system message only first."""
    env = Message(role="system", content=[TextPart("<env>linux</env>")], in_turns=True)
    later = Message(role="system", content=[TextPart("Be brief.")], in_turns=True)
    conv = conversation_from_openai(PLAIN if system else NO_SYSTEM)
    conv.messages[1:1] = [env]
    conv.messages.append(later)
    head = "You are terse.\n\n" if system else ""
    merged = [{"role": "system", "content": head + "<env>linux</env>\n\nBe brief."}]
    rest = PLAIN[1:] if system else NO_SYSTEM
    hf = hf_tokenizer(template(source))
    expected = hf.apply_chat_template(merged + rest, tokenize=False, add_generation_prompt=True)
    assert ChatTemplateRenderer(template(source), hf.special_tokens_map).render(conv) == expected


def test_llama31_template_errors_become_recipe_errors():
    """`raise_exception` in a template surfaces as a RecipeError naming the messages."""
    messages = copy.deepcopy(TOOL_LOOP)
    renderer = ChatTemplateRenderer(template("llama3_3_instruct.jinja"), {"bos_token": "<s>"})
    with pytest.raises(RecipeError, match="only supports single tool-calls") as err:
        renderer.render(conversation_from_openai(messages, TOOLS))
    assert err.value.param == "messages"


@pytest.mark.parametrize("messages", [PLAIN, NO_SYSTEM], ids=["plain", "no-system"])
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_and_tokens_match_transformers(smollm2, messages, gen):
    """The default model's template (from its GGUF) renders, and tokenizes, as transformers does."""
    info, bpe = smollm2
    hf = hf_tokenizer(info.chat_template, bpe, **info.special_tokens)
    conv = conversation_from_openai(messages)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert (
        ChatTemplateRenderer(info.chat_template, info.special_tokens).render(conv, add_generation_prompt=gen)
        == expected
    )
    if gen:
        prompt = Recipe.for_model(info).render(conv, tokenizer=bpe)
        assert prompt.text == expected
        assert prompt.token_ids == hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert prompt.token_ids[:3] == [1, 9690, 198]  # <|im_start|> system \n


def test_smollm2_gets_hermes_tools_in_its_system_message(smollm2):
    """SmolLM2's template knows no tools: the tool list joins the system message, calls are written
    as <tool_call> blocks with the raw arguments, results come back as a user turn."""
    info, bpe = smollm2
    hermes_system = (
        "Use tools.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )
    by_hand = [
        {"role": "system", "content": hermes_system},
        TOOL_LOOP[1],
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"temp": "18°C"}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>',
        },
    ]
    expected = hf_tokenizer(info.chat_template, bpe, **info.special_tokens).apply_chat_template(
        by_hand, tokenize=False, add_generation_prompt=True
    )
    prompt = Recipe.for_model(info).render(conversation_from_openai(TOOL_LOOP, TOOLS))
    assert prompt.text == expected
    assert prompt.parser_spec.tool_format == "hermes"
    assert prompt.parser_spec.stop_markers == ("<|im_end|>",)


def test_arguments_are_never_double_encoded():
    """Raw-string arguments reach templates as dicts (tojson encodes them once) and Hermes text verbatim."""
    conv = conversation_from_openai(SINGLE_CALL, TOOLS)
    for source in ("qwen2_5_instruct.jinja", "qwen3.jinja"):
        text = ChatTemplateRenderer(template(source)).render(conv)
        assert '"arguments": {"city": "Paris"}}' in text
        assert '\\"city\\"' not in text
    hermes = ChatTemplateRenderer("{% for m in messages %}{{ m.content }}\n{% endfor %}").render(
        Conversation(
            messages=[
                Message(role="user", content=[TextPart("q")]),
                Message(role="assistant", tool_calls=[ToolCall(id="a", name="f", arguments='{"k":[1,2]}')]),
            ]
        )
    )
    assert '<tool_call>\n{"name": "f", "arguments": {"k":[1,2]}}\n</tool_call>' in hermes


def test_jinja_environment_features():
    """strftime_now (injectable clock), loop controls, namespace, dict, tojson options and the
    generation tag behave as in transformers."""
    source = (
        "{{ strftime_now('%d %b %Y') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content }}{% endfor %}|{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|"
        "{{ dict(a=1) | tojson }}|{{ {'b': 'é'} | tojson(indent=1) }}|{% generation %}G{% endgeneration %}"
    )
    conv = conversation_from_openai([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    ours = ChatTemplateRenderer(source, now=lambda: datetime(2024, 7, 26)).render(conv)
    assert ours == '26 Jul 2024|one|2|{"a": 1}|{\n "b": "é"\n}|G'
    expected = hf_tokenizer(source).apply_chat_template(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], tokenize=False
    )
    assert ours.split("|", 1)[1] == expected.split("|", 1)[1]


def test_template_sandbox_refuses_underscore_namespace_attributes():
    """Templates are untrusted code: the sandbox rules of transformers apply."""
    renderer = ChatTemplateRenderer("{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(Exception, match="underscore"):
        renderer.render(conversation_from_openai([{"role": "user", "content": "q"}]))


def test_template_features_detection():
    """Tool syntax and thinking are read from the template source."""
    assert TemplateFeatures.of(template("qwen3.jinja")) == TemplateFeatures(True, True, "hermes", True)
    assert TemplateFeatures.of(template("llama3_3_instruct.jinja")).tool_format == "llama3_json"
    assert TemplateFeatures.of(template("deepseek_v31.jinja")).tool_format == "deepseek_v31"
    assert TemplateFeatures.of(template("deepseek_r1.jinja")).tool_format == "deepseek_r1"
    plain = TemplateFeatures.of("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert (plain.native_tools, plain.tool_format, plain.can_think) == (False, "hermes", False)
    unknown = (
        "{% for t in tools %}[TOOL]{{ t }}{% endfor %}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    )
    with pytest.raises(RecipeError) as err:
        ChatTemplateRenderer(unknown).render(conversation_from_openai(SINGLE_CALL[:2], TOOLS))
    assert err.value.param == "tools"


def test_qwen3_prompt_state_for_the_parser():
    """Qwen3 may open `<think>` itself (maybe-reasoning); with thinking off the prompt closes it."""
    recipe = Recipe(
        "chat_template", chat_template=template("qwen3.jinja"), special_tokens={"eos_token": "<|im_end|>"}
    )
    on = recipe.render(conversation_from_openai(PLAIN))
    off = recipe.render(conversation_from_openai(PLAIN, thinking=False))
    assert on.parser_spec.initial == "maybe_reasoning"
    assert off.parser_spec.initial == "content"
    done = on.parse_completion("<think>\nLet me count.\n</think>\n\n1, 2, 3.<|im_end|>")
    assert (done.reasoning, done.content, done.finish_reason) == ("Let me count.", "1, 2, 3.", "stop")
