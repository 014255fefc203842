"""The pairing facade: family detection from model metadata, and render → parse round trips."""

from __future__ import annotations

import json

import pytest

from deepinfer.recipe import ModelInfo, Recipe, RecipeError, parse_completion, resolve_family
from deepinfer.recipe.ir import Conversation, Message, TextPart, Thinking, Tool, ToolCall
from deepinfer.recipe.render.deepseek_v32 import render_invoke
from tests.recipe.conftest import template


def test_family_detection():
    """Explicit family wins; deepseek_v32 is native, and so is a template-less deepseek_v3;
    DeepSeek templates pick V3.1/R1; others use their chat template; template-less others are refused."""
    assert resolve_family(ModelInfo(model_type="llama", family="deepseek_r1")) == "deepseek_r1"
    assert resolve_family(ModelInfo(model_type="deepseek_v32")) == "deepseek_v32"
    assert resolve_family(ModelInfo(model_type="deepseek_v3")) == "deepseek_v32"
    assert (
        resolve_family(ModelInfo(model_type="deepseek_v3", chat_template=template("deepseek_v31.jinja")))
        == "deepseek_v31"
    )
    assert (
        resolve_family(ModelInfo(model_type="deepseek_v3", chat_template=template("deepseek_r1.jinja")))
        == "deepseek_r1"
    )
    assert (
        resolve_family(ModelInfo(model_type="qwen3", chat_template=template("qwen3.jinja")))
        == "chat_template"
    )
    for bad, param in (
        (ModelInfo(model_type="llama"), "chat_template"),
        (ModelInfo(family="gpt"), "family"),
    ):
        with pytest.raises(RecipeError) as err:
            resolve_family(bad)
        assert err.value.param == param


def test_model_info_from_the_default_gguf(smollm2, smollm2_gguf):
    """The default model's GGUF gives its architecture, template and special tokens."""
    info, _ = smollm2
    assert ModelInfo.from_gguf(smollm2_gguf) == info
    assert info.model_type == "llama"
    assert info.chat_template.startswith("{% for message in messages %}")
    assert info.special_tokens["eos_token"] == "<|im_end|>"
    assert Recipe.for_model(info).family == "chat_template"


def test_model_info_from_a_hf_folder(tmp_path):
    """config.json + tokenizer_config.json (token dicts, named templates) are read without transformers."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|im_end|>", "special": True},
                "bos_token": None,
                "chat_template": [
                    {"name": "default", "template": template("qwen3.jinja")},
                    {"name": "rag", "template": "x"},
                ],
            }
        )
    )
    info = ModelInfo.from_hf_dir(tmp_path)
    assert (info.model_type, info.special_tokens) == ("qwen3", {"eos_token": "<|im_end|>"})
    assert info.chat_template == template("qwen3.jinja")
    prompt = Recipe.for_model(info).render(
        Conversation(messages=[Message(role="user", content=[TextPart("q")])])
    )
    assert prompt.parser_spec.stop_markers == ("<|im_end|>",)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v31", "deepseek_r1", "qwen3"])
def test_rendered_assistant_turn_parses_back(family):
    """What a family writes for an assistant tool-call turn parses back to the same calls: the
    renderer and the parser speak the same syntax (DSML arguments come back in reference JSON)."""
    recipe = (
        Recipe(
            "chat_template", chat_template=template("qwen3.jinja"), special_tokens={"eos_token": "<|im_end|>"}
        )
        if family == "qwen3"
        else Recipe(family)
    )
    calls = [
        ToolCall("a", "get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ToolCall("b", "get_time", "{}"),
    ]
    user = Message(role="user", content=[TextPart("q")])
    tools = [Tool("get_weather"), Tool("get_time")]
    prompt = recipe.render(Conversation(messages=[user], tools=tools, thinking=Thinking(enabled=False)))
    full = recipe.render(
        Conversation(
            messages=[user, Message(role="assistant", content=[TextPart("On it.")], tool_calls=calls)],
            tools=tools,
        )
    )
    # The model's reply is what the renderer wrote for the turn (after an empty reasoning, if any).
    reply = full.text[full.text.index("On it.") :]
    parsed = parse_completion(
        ("</think>" if prompt.parser_spec.initial == "reasoning" else "") + reply, prompt
    )
    assert parsed.content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {}),
    ]
    assert parsed.finish_reason == "tool_calls"


def test_dsml_arguments_round_trip_to_reference_json():
    """DSML parameters parse back to json.dumps(arguments, ensure_ascii=False) of flat objects."""
    arguments = {"s": 'ü "q"\n', "n": 3, "l": [1, None], "b": False}
    call = ToolCall("a", "f", json.dumps(arguments))
    prompt = Recipe("deepseek_v32").render(
        Conversation(messages=[Message(role="user", content=[TextPart("q")])], tools=[Tool("f")])
    )
    block = f"\n\n<｜DSML｜function_calls>\n{render_invoke(call)}\n</｜DSML｜function_calls>"
    parsed = prompt.parse_completion(block)
    assert parsed.tool_calls[0].arguments == json.dumps(arguments, ensure_ascii=False)


def test_token_ids_need_a_tokenizer(smollm2):
    """Token ids are produced only when a tokenizer is given, and decode back to the text."""
    info, bpe = smollm2
    conv = Conversation(messages=[Message(role="user", content=[TextPart("héllo 🎉")])])
    recipe = Recipe.for_model(info)
    assert recipe.render(conv).token_ids is None
    prompt = recipe.render(conv, tokenizer=bpe)
    assert bpe.decode(prompt.token_ids, skip_special_tokens=False) == prompt.text


APPLY_PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch (client's words).",
}


@pytest.mark.parametrize("source", ["smollm2", "llama3_3_instruct.jinja"])
def test_apply_patch_keeps_the_clients_description_outside_deepseek_v4(smollm2, source: str) -> None:
    """Only the DeepSeek V4 encodings replace the apply_patch custom tool's description (their
    codec does); a chat template shows what the client wrote."""
    from deepinfer.recipe.api import responses_to_conversation
    from deepinfer.recipe.apply_patch import APPLY_PATCH_DESCRIPTION

    body = {"model": "m", "input": "fix a.py", "tools": [APPLY_PATCH_TOOL]}
    conv = responses_to_conversation(body)
    recipe = (
        Recipe.for_model(smollm2[0])
        if source == "smollm2"
        else Recipe("chat_template", chat_template=template(source))
    )
    text = recipe.render(conv).text
    assert APPLY_PATCH_TOOL["description"] in text and "Begin Patch" in text  # the input's own words
    assert APPLY_PATCH_DESCRIPTION.splitlines()[1] not in text
    v41 = Recipe("deepseek_v41").render(responses_to_conversation(body)).text
    assert APPLY_PATCH_DESCRIPTION.splitlines()[1] in v41 and APPLY_PATCH_TOOL["description"] not in v41
