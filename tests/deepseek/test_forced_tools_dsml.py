"""Forced tool calls for the DSML family (DeepSeek-V3.2's native format) on a tiny random DeepSeek
checkpoint: the server's constraint for tool_choice, run by the engine, parsed by the V3.2 parser.

A random model never writes a tool call on its own, so every well-formed call here is the
grammar's doing. With thinking on, the thinking section stays free: greedy output under the
constraint equals greedy output without it until `</think>`.
"""

from __future__ import annotations

import json

import pytest

from deepinfer import SamplingParams
from deepinfer.recipe import ModelInfo, Recipe, RenderedPrompt
from deepinfer.recipe.ir import Conversation, Message, TextPart, Thinking, Tool, ToolChoice
from deepinfer.server.constraints import CHAT_FORMAT, output_constraint
from deepinfer.structured import GrammarSpec
from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint
from tests.structured.validation import strict_validator

FORECAST = Tool(
    "get_forecast",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
)
CLOCK = Tool(
    "get_time",
    parameters={
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)
SCHEMAS = {t.name: t.parameters for t in (FORECAST, CLOCK)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> TinyCheckpoint:
    # V3.2's tool instructions alone are over a thousand tokens of the tiny vocabulary: a longer
    # context than the shared tiny checkpoints have, and no MTP (not needed here).
    overrides = {"max_position_embeddings": 4096, "rope_scaling": None, "num_nextn_predict_layers": 0}
    return build_checkpoint(tmp_path_factory.mktemp("dsml_tools"), overrides, fp8=False, seed=4)


@pytest.fixture(scope="module")
def llm(ckpt: TinyCheckpoint):
    from deepinfer import LLM

    llm = LLM(model=str(ckpt.path), num_blocks=512, num_threads=1)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def recipe(ckpt: TinyCheckpoint) -> Recipe:
    recipe = Recipe.for_model(ModelInfo.from_hf_dir(ckpt.path))
    assert recipe.family == "deepseek_v32"  # a deepseek_v3 config without a chat template
    return recipe


def _render(recipe: Recipe, llm, choice: ToolChoice, thinking: bool) -> tuple[RenderedPrompt, Conversation]:
    conv = Conversation(
        messages=[Message(role="user", content=[TextPart("What will the weather be in Paris?")])],
        tools=[FORECAST, CLOCK],
        tool_choice=choice,
        thinking=Thinking(enabled=thinking),
    )
    return recipe.render(conv, tokenizer=llm.get_tokenizer().backend), conv


def _generate(llm, prompt: RenderedPrompt, params: SamplingParams, grammar: GrammarSpec | None):
    """The CompletionOutput of one request run to completion on the offline engine."""
    engine = llm.engine
    prepared = engine.prepare_prompt(prompt.token_ids)
    engine.validate(prepared, params)
    if grammar is not None:
        engine.core.grammars.validate(grammar)  # what the server's API side checks first
    request_id = engine.enqueue(prepared, params, grammar=grammar)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output.outputs[0]
    assert final is not None
    return final


def _textual_prefix(llm, token_ids: list[int]) -> int:
    """How many leading tokens decode to valid text. Grammars match UTF-8 text, so a random
    model's special tokens (as the grammar backend counts them) and broken byte sequences are
    the one thing even a free section refuses."""
    tokenizer = llm.get_tokenizer()
    grammar_special = llm.engine.core.grammars.backend.tokenizer_info.special_tokens
    special = {tokenizer.backend.token_to_id(text) for text in grammar_special}
    for i, token in enumerate(token_ids):
        if token in special or "\ufffd" in tokenizer.backend.decode(
            token_ids[: i + 1], skip_special_tokens=False
        ):
            return i
    return len(token_ids)


def _constraint(llm, conv: Conversation, prompt: RenderedPrompt, parallel: bool) -> GrammarSpec:
    special = llm.engine.core.grammars.backend.tokenizer_info.special_tokens
    spec = output_constraint(conv, prompt, CHAT_FORMAT, parallel_calls=parallel, special_tokens=special)
    assert spec is not None
    return spec


@pytest.mark.parametrize(
    ("choice", "seed"),
    [(ToolChoice("required"), 0), (ToolChoice("required"), 1), (ToolChoice("named", "get_time"), 2)],
    ids=["required-0", "required-1", "named"],
)
def test_forced_dsml_call_without_thinking(llm, recipe, choice: ToolChoice, seed: int) -> None:
    prompt, conv = _render(recipe, llm, choice, thinking=False)
    assert prompt.parser_spec.tool_format == "dsml" and prompt.parser_spec.initial == "content"
    parallel = seed == 1
    spec = _constraint(llm, conv, prompt, parallel=parallel)
    assert spec.after_reasoning is None
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, skip_special_tokens=False)
    output = _generate(llm, prompt, params, spec)
    text, finish = output.text, output.finish_reason
    if parallel:  # the random model may go on calling until the token limit; complete calls count
        assert finish in ("stop", "length"), text
    else:
        assert finish == "stop", text  # the grammar ended, so only EOS was left
    parsed = prompt.parse_completion(text, finish_reason=finish)  # type: ignore[arg-type]
    assert parsed.tool_calls, text
    assert parsed.finish_reason == ("tool_calls" if finish == "stop" else "length")
    if finish == "stop":
        assert not parsed.content.strip()  # (a call cut by the limit comes back as text)
    for call in parsed.tool_calls:
        assert choice.mode != "named" or call.name == choice.name
        strict_validator(SCHEMAS[call.name]).validate(json.loads(call.arguments))


def test_thinking_stays_free_and_the_call_follows_it(llm, recipe) -> None:
    prompt, conv = _render(recipe, llm, ToolChoice("named", "get_forecast"), thinking=True)
    assert prompt.parser_spec.initial == "reasoning"  # the prompt ends with <think>
    spec = _constraint(llm, conv, prompt, parallel=False)
    assert spec.after_reasoning == "</think>"

    # The thinking section is not constrained: greedy tokens are the unconstrained ones (as far
    # as those are text at all).
    greedy = SamplingParams(max_tokens=24, temperature=0, skip_special_tokens=False)
    free = _generate(llm, prompt, greedy, None)
    assert "</think>" not in free.text
    textual = _textual_prefix(llm, free.token_ids)
    assert textual >= 2, free.text  # the comparison below means something
    constrained = _generate(llm, prompt, greedy, spec)
    assert constrained.token_ids[:textual] == free.token_ids[:textual]
    # 24 tokens of thinking, none of it the forced call, and the call still owed (no EOS yet).
    assert constrained.finish_reason == "length" and len(constrained.token_ids) == 24
    assert "DSML" not in constrained.text and "</think>" not in constrained.text

    # Once the model closes its thinking (pushed here with a logit bias, as the random model
    # would not), the answer is the forced call.
    end_think = llm.get_tokenizer().backend.token_to_id("</think>")
    biased = SamplingParams(
        max_tokens=400, temperature=1.0, seed=3, logit_bias={end_think: 30.0}, skip_special_tokens=False
    )
    output = _generate(llm, prompt, biased, spec)
    text = output.text
    assert output.finish_reason == "stop" and text.startswith("</think>"), text
    parsed = prompt.parse_completion(text)
    assert [call.name for call in parsed.tool_calls] == ["get_forecast"], text
    strict_validator(SCHEMAS["get_forecast"]).validate(json.loads(parsed.tool_calls[0].arguments))
