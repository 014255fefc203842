"""DeepSeek V4 / V4.1 prompts against DeepSeek's own codec (`deepseek-recipe` 0.2.0).

For generated requests of all three APIs, and hand-written ones for the rules the generator does
not reach: the prompt is byte-exact, the token ids are identical, and where the codec refuses a
request ours refuses it too (a RecipeError, the server's 400).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest

from deepinfer.recipe import Recipe, RecipeError
from deepinfer.recipe.api import (
    chat_completion_to_conversation,
    messages_to_conversation,
    responses_to_conversation,
)
from tests.recipe.deepseek_reference import (
    BODIES,
    MODELS,
    deepseek_recipe,
    reference,
    scenario,
    tokenizer_json,
)

OURS = {
    "chat": chat_completion_to_conversation,
    "responses": responses_to_conversation,
    "messages": messages_to_conversation,
}
GENERATED = 150  # cases per API and family
TOKENIZED = 25  # of which also compared token for token


@cache
def tokenizers_for(family: str) -> tuple[Any, Any]:
    """(deepseek_recipe.Tokenizer, tokenizers.Tokenizer) of the same tokenizer.json."""
    from tokenizers import Tokenizer

    text = tokenizer_json(family)
    return deepseek_recipe.Tokenizer.from_str(text), Tokenizer.from_str(text)


def ours(api: str, body: dict[str, Any], family: str, tokenizer: Any = None) -> tuple[Any, str | None]:
    try:
        conv = OURS[api](body)
        return Recipe(family).render(conv, tokenizer=tokenizer), None
    except RecipeError as error:
        return None, str(error)


def compare(api: str, body: dict[str, Any], family: str, *, tokens: bool) -> str:
    """'same', 'both_refuse', or a description of the difference."""
    ref_tok, our_tok = tokenizers_for(family) if tokens else (None, None)
    ref = reference(api, body, family, ref_tok)
    prompt, error = ours(api, body, family, our_tok)
    if ref.error is not None:
        return "both_refuse" if error is not None else f"the codec refuses ({ref.error}), ours does not"
    if error is not None:
        return f"ours refuses ({error}), the codec does not"
    if prompt.text != ref.prompt:
        at = next(i for i, (a, b) in enumerate(zip(prompt.text + "\0", ref.prompt + "\0")) if a != b)
        return f"prompts differ at {at}: ours {prompt.text[at - 40 : at + 40]!r}, codec {ref.prompt[at - 40 : at + 40]!r}"
    if tokens and prompt.token_ids != ref.token_ids:
        return "token ids differ"
    return "same"


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("api", list(BODIES))
def test_generated_requests_match_the_codec(api: str, family: str) -> None:
    outcomes: dict[str, int] = {}
    failures = []
    for seed in range(GENERATED):
        body = BODIES[api](scenario(seed))
        outcome = compare(api, body, family, tokens=seed < TOKENIZED)
        outcomes[outcome if outcome in ("same", "both_refuse") else "different"] = (
            outcomes.get(outcome if outcome in ("same", "both_refuse") else "different", 0) + 1
        )
        if outcome not in ("same", "both_refuse"):
            failures.append((seed, outcome))
    assert not failures, failures[:5]
    assert outcomes.get("same", 0) >= GENERATED * 0.6, outcomes  # the generator mostly makes valid requests


def _u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# Rules the generator does not reach: (api, body).
HANDWRITTEN: dict[str, tuple[str, dict[str, Any]]] = {
    "latest-reminder": (
        "chat",
        {"messages": [_u("a"), {"role": "latest_reminder", "content": "stay brief"}]},
    ),
    "reminder-mid-conversation": (
        "chat",
        {
            "messages": [
                _u("a"),
                {"role": "latest_reminder", "content": "r"},
                {"role": "assistant", "content": "b"},
                _u("c"),
            ]
        },
    ),
    "system-after-user": ("chat", {"messages": [_u("a"), {"role": "system", "content": "s"}, _u("b")]}),
    "two-systems-and-tools": (
        "chat",
        {
            "messages": [{"role": "system", "content": "s1"}, {"role": "system", "content": "s2"}, _u("a")],
            "tools": [TOOL],
        },
    ),
    "system-after-user-with-tools": (
        "chat",
        {"messages": [_u("a"), {"role": "system", "content": "s"}, _u("b")], "tools": [TOOL]},
    ),
    "prefix-with-reasoning": (
        "chat",
        {
            "messages": [
                _u("a"),
                {"role": "assistant", "content": "", "reasoning_content": "hm", "prefix": True},
            ]
        },
    ),
    "prefix-thinking-off": (
        "chat",
        {
            "messages": [_u("a"), {"role": "assistant", "content": "Sure", "prefix": True}],
            "thinking": {"type": "disabled"},
        },
    ),
    "strict-tools": (
        "chat",
        {
            "messages": [_u("a")],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "s",
                        "strict": True,
                        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                    },
                }
            ],
        },
    ),
    "forced-named-tool": (
        "chat",
        {
            "messages": [_u("a")],
            "tools": [TOOL, {**TOOL, "function": {**TOOL["function"], "name": "g"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "thinking": {"type": "disabled"},
        },
    ),
    "forced-call-while-thinking": (
        "chat",
        {"messages": [_u("a")], "tools": [TOOL], "tool_choice": "required"},
    ),
    "responses-namespace-custom-and-hosted-tools": (
        "responses",
        {
            "input": "hi",
            "tools": [
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {"type": "object", "properties": {}},
                    "defer_loading": True,
                },
                {
                    "type": "namespace",
                    "name": "mcp__srv",
                    "description": "Server tools",
                    "tools": [
                        {
                            "type": "function",
                            "name": "read",
                            "description": "R",
                            "parameters": {"type": "object", "properties": {}},
                        }
                    ],
                },
                {"type": "web_search"},
            ],
        },
    ),
    "responses-developer": (
        "responses",
        {
            "input": [
                {"type": "message", "role": "developer", "content": "dev"},
                {"type": "message", "role": "user", "content": "u"},
            ],
            "instructions": "ins",
        },
    ),
    "responses-reasoning-only-item": (
        "responses",
        {
            "input": [
                {"type": "message", "role": "user", "content": "u"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                {"type": "message", "role": "user", "content": "v"},
            ]
        },
    ),
    "messages-any-while-thinking": (
        "messages",
        {
            "messages": [_u("a")],
            "max_tokens": 64,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
            "tool_choice": {"type": "any"},
        },
    ),
    "messages-tool-result-then-text": (
        "messages",
        {
            "messages": [
                _u("a"),
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
            "max_tokens": 64,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
        },
    ),
    # Claude Code's environment block: `system` entries among the messages (V4.1 a system turn
    # where it stands, V4 a <system-reminder> in the user turn).
    "messages-system-entries": (
        "messages",
        {
            "system": [
                {"type": "text", "text": "You are Claude Code."},
                {"type": "text", "text": "Be terse."},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": "<env>linux</env>"},
                        {"type": "text", "text": "cwd /x"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
                {"role": "system", "content": "later"},
            ],
            "max_tokens": 64,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
        },
    ),
    "messages-system-entry-first": (
        "messages",
        {
            "messages": [{"role": "system", "content": "env"}, _u("a")],
            "max_tokens": 64,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
            "thinking": {"type": "disabled"},
        },
    ),
    "json-object-without-the-word": (
        "chat",
        {"messages": [_u("hi")], "response_format": {"type": "json_object"}},
    ),
    "nested-arguments": (
        "chat",
        {
            "messages": [
                _u("a"),
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {
                                "name": "f",
                                "arguments": json.dumps({"o": {"k": [1, "é", None]}, "b": True, "s": "x\ny"}),
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
            "tools": [TOOL],
        },
    ),
}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("case", list(HANDWRITTEN))
def test_handwritten_requests_match_the_codec(case: str, family: str) -> None:
    api, body = HANDWRITTEN[case]
    assert compare(api, body, family, tokens=True) in ("same", "both_refuse")


def _call(call_id: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}


# Codex's apply_patch as it declares it: a free-form tool with its own description and grammar.
CODEX_APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?',
    },
}
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
    },
}
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch"

# Histories the codec renders, where ours once refused or wrote another prompt: (api, body).
RENDERED: dict[str, tuple[str, dict[str, Any]]] = {
    # Arguments that are not a JSON object (a model emits malformed ones now and then): written as
    # the client sent them, so that the agent can send its history again.
    "chat-arguments-not-a-json-object": (
        "chat",
        {
            "messages": [
                _u("a"),
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        _call("c1", '{"city": "Par'),
                        _call("c2", "not json"),
                        _call("c3", "[1, 2]"),
                        _call("c4", ""),
                        _call("c5", '{"x": 1}}'),
                    ],
                },
                *({"role": "tool", "tool_call_id": f"c{k}", "content": "ok"} for k in range(1, 6)),
            ],
            "tools": [TOOL],
        },
    ),
    "responses-arguments-not-a-json-object": (
        "responses",
        {
            "input": [
                _u("a"),
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command": ["ls"'},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "tools": [SHELL],
        },
    ),
    # A reasoning item holding only a summary is not replayed (a summary is not the reasoning).
    "responses-reasoning-summary-only": (
        "responses",
        {
            "input": [
                _u("a"),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "Look first."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "shell",
                    "arguments": '{"command": ["ls"]}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {
                    "type": "reasoning",
                    "id": "rs_2",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Now."}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Done."}],
                },
                _u("b"),
            ],
            "tools": [SHELL],
        },
    ),
    # A Codex session's apply_patch: described as the codec describes it, whatever Codex says.
    "responses-codex-apply-patch": (
        "responses",
        {
            "instructions": "You are Codex, a coding agent.",
            "input": [
                _u("set x to 2"),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "Patch it."}],
                },
                {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": PATCH},
                {"type": "custom_tool_call_output", "call_id": "p1", "output": "Success. Updated a.py"},
            ],
            "tools": [SHELL, CODEX_APPLY_PATCH],
            "reasoning": {"effort": "medium", "summary": "auto"},
        },
    ),
}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("case", list(RENDERED))
def test_histories_the_codec_renders_match_token_for_token(case: str, family: str) -> None:
    api, body = RENDERED[case]
    assert compare(api, body, family, tokens=True) == "same"


def test_v41_refuses_a_tokenizer_without_its_system_token() -> None:
    """V4's tokenizer lacks `<｜System｜>`: V4.1 prompts that need it are refused by name, as the
    codec refuses them; prompts that do not need it encode to the codec's ids."""
    from tokenizers import Tokenizer

    codec_v4_tokenizer = tokenizers_for("deepseek_v4")[0]
    v4 = Tokenizer.from_str(tokenizer_json("deepseek_v4"))
    body = {"messages": [_u("hi")]}
    with pytest.raises(RecipeError, match="<｜System｜>"):
        Recipe("deepseek_v41").render(chat_completion_to_conversation(body), tokenizer=v4)
    with pytest.raises(RuntimeError, match="<｜System｜>"):
        reference("chat", body, "deepseek_v41", codec_v4_tokenizer)
    plain = {"messages": [_u("hi")], "thinking": {"type": "disabled"}}
    ids = Recipe("deepseek_v41").render(chat_completion_to_conversation(plain), tokenizer=v4).token_ids
    assert ids == reference("chat", plain, "deepseek_v41", codec_v4_tokenizer).token_ids
