"""Responses features real agents use: namespace tools, the apply_patch custom tool, hosted tools,
encrypted reasoning and prompt_cache_key (Codex CLI sends all of them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deepinfer.recipe import Recipe, RecipeError
from deepinfer.recipe.api import build_response, responses_to_conversation
from deepinfer.recipe.api.responses import ResponsesOptions
from deepinfer.recipe.api.responses_encoder import ResponsesEncoder
from deepinfer.recipe.api.responses_reasoning import ReasoningSealer
from deepinfer.recipe.events import Finish, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}}
NAMESPACE = {
    "type": "namespace",
    "name": "mcp__files",
    "description": "Files on disk",
    "tools": [{"type": "function", "name": "read", "description": "Read a file", "parameters": PARAMS}],
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}
CODEX_LIKE = {
    "model": "m",
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}},
        NAMESPACE,
        APPLY_PATCH,
        {"type": "web_search", "external_web_access": False},
    ],
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "session-1",
    "client_metadata": {"originator": "codex_exec"},
    "stream": True,
}


def test_codex_request_converts_with_flattened_namespace_and_dropped_hosted_tools() -> None:
    conv = responses_to_conversation(CODEX_LIKE)
    names = [t.name for t in conv.tools]
    assert names == ["shell", "mcp__files::read", "apply_patch"]  # web_search dropped
    read = conv.tools[1]
    assert (read.namespace, read.local_name, read.description) == (
        "mcp__files",
        "read",
        "Files on disk\nRead a file",
    )
    patch = conv.tools[2]
    assert patch.custom and patch.parameters["required"] == ["input"]
    assert conv.prompt_cache_key == "session-1"


def test_hosted_tools_can_be_refused_instead() -> None:
    with pytest.raises(RecipeError) as caught:
        responses_to_conversation(CODEX_LIKE, ResponsesOptions(hosted_tools="reject"))
    assert caught.value.param == "tools[3].type"


def test_other_custom_tools_are_refused_by_name() -> None:
    body = {**CODEX_LIKE, "tools": [{"type": "custom", "name": "sql"}]}
    with pytest.raises(RecipeError) as caught:
        responses_to_conversation(body)
    assert caught.value.param == "tools[0].name"


def test_namespaced_and_custom_calls_come_back_in_history() -> None:
    body = {
        **CODEX_LIKE,
        "input": [
            *CODEX_LIKE["input"],
            {
                "type": "function_call",
                "call_id": "a",
                "namespace": "mcp__files",
                "name": "read",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "a", "output": "text"},
            {"type": "custom_tool_call", "call_id": "b", "name": "apply_patch", "input": "*** Begin Patch\n"},
            {"type": "custom_tool_call_output", "call_id": "b", "output": "Done"},
        ],
    }
    conv = responses_to_conversation(body)
    calls = [c for m in conv.messages for c in m.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("mcp__files::read", {}),
        ("apply_patch", {"input": "*** Begin Patch\n"}),
    ]
    prompt = Recipe("deepseek_v41").render(conv).text
    assert '<｜DSML｜ invoke name="mcp__files::read">' in prompt
    assert '<｜DSML｜ parameter name="input" string="true">*** Begin Patch\n</｜DSML｜ parameter>' in prompt


def _call_events(name: str, arguments: str) -> list[Any]:
    return [
        ReasoningDelta("I will."),
        ToolCallStart(index=0, id="call_1", name=name),
        ToolCallArgsDelta(index=0, delta=arguments),
        ToolCallEnd(index=0, arguments=arguments),
        Finish("tool_calls"),
    ]


def test_namespaced_call_is_split_in_items_and_events() -> None:
    conv = responses_to_conversation(CODEX_LIKE)
    encoder = ResponsesEncoder(response_id="resp_1", model="m", created_at=0, tools=conv.tools)
    frames = [f for e in _call_events("mcp__files::read", '{"path": "a"}') for f in encoder.feed(e)]
    frames += encoder.close()
    added = [json.loads(f.split("data: ", 1)[1]) for f in frames if "output_item.added" in f]
    call_item = added[-1]["item"]
    assert (call_item["type"], call_item["namespace"], call_item["name"]) == (
        "function_call",
        "mcp__files",
        "read",
    )
    body = build_response(
        _call_events("mcp__files::read", "{}"),
        response_id="resp_1",
        model="m",
        created_at=0,
        tools=conv.tools,
    )
    assert body["output"][-1]["namespace"] == "mcp__files" and body["output"][-1]["name"] == "read"


def test_apply_patch_call_is_a_custom_tool_call_item() -> None:
    conv = responses_to_conversation(CODEX_LIKE)
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    arguments = json.dumps({"input": patch})
    encoder = ResponsesEncoder(response_id="resp_1", model="m", created_at=0, tools=conv.tools)
    frames = [f for e in _call_events("apply_patch", arguments) for f in encoder.feed(e)] + encoder.close()
    kinds = [f.split("\n", 1)[0].removeprefix("event: ") for f in frames]
    assert "response.custom_tool_call_input.done" in kinds
    assert "response.function_call_arguments.delta" not in kinds
    body = build_response(
        _call_events("apply_patch", arguments),
        response_id="resp_1",
        model="m",
        created_at=0,
        tools=conv.tools,
    )
    item = body["output"][-1]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", patch)


def test_encrypted_reasoning_round_trips_and_refuses_tampering() -> None:
    sealer = ReasoningSealer.generate()
    body = build_response(
        _call_events("shell", "{}"), response_id="resp_1", model="m", created_at=0, seal_reasoning=sealer.seal
    )
    reasoning = body["output"][0]
    assert reasoning["type"] == "reasoning" and "I will." not in reasoning["encrypted_content"]
    # The next stateless turn sends the item back without its text: it decrypts into the reasoning.
    follow_up = {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": "go"},
            {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        ],
        "tools": CODEX_LIKE["tools"][:1],
    }
    conv = responses_to_conversation(follow_up, ResponsesOptions(reasoning=sealer))
    assert conv.messages[1].reasoning[0].text == "I will."
    assert "<think>I will.</think>" in Recipe("deepseek_v41").render(conv).text
    blob = reasoning["encrypted_content"]
    tampered = blob[:-6] + ("A" if blob[-6] != "A" else "B") + blob[-5:]
    for bad, sealer_used in ((tampered, sealer), (blob, ReasoningSealer.generate())):
        follow_up["input"][1]["encrypted_content"] = bad
        with pytest.raises(RecipeError) as caught:
            responses_to_conversation(follow_up, ResponsesOptions(reasoning=sealer_used))
        assert caught.value.param == "input[1].encrypted_content"


def test_v4_writes_namespaced_functions_its_own_way_and_reads_them_back() -> None:
    """V4 names a namespaced function NS__NAME (V4.1: NS::NAME); either way the call comes back
    under the request's tool, split into namespace and name."""
    conv = responses_to_conversation(CODEX_LIKE)
    prompt = Recipe("deepseek_v4").render(conv)
    assert '{"name": "mcp__files__read", "description": "Read a file"' in prompt.text
    text = '</think><｜DSML｜tool_calls>\n<｜DSML｜invoke name="mcp__files__read">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    conv.thinking.enabled = False
    parsed = Recipe("deepseek_v4").render(conv).parse_completion(text.removeprefix("</think>"))
    assert [c.name for c in parsed.tool_calls] == ["mcp__files::read"]
