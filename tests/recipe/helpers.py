"""Test-side helpers: OpenAI-style dicts to the IR, and the IR back to the dicts transformers reads.

The server's real request parsing lives in deepinfer.recipe.api; these helpers stay tiny and
independent so the renderer tests do not depend on it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from deepinfer.recipe.ir import Conversation, Message, Reasoning, TextPart, Thinking, Tool, ToolCall


def conversation_from_openai(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *, thinking: bool | None = None
) -> Conversation:
    ir_messages = []
    for m in messages:
        content = m.get("content")
        parts = [TextPart(content)] if content else []
        calls = [
            ToolCall(
                id=c.get("id", f"call_{k}"),
                name=c["function"]["name"],
                arguments=(
                    c["function"]["arguments"]
                    if isinstance(c["function"]["arguments"], str)
                    else json.dumps(c["function"]["arguments"])
                ),
            )
            for k, c in enumerate(m.get("tool_calls") or [])
        ]
        reasoning = [Reasoning(m["reasoning_content"])] if m.get("reasoning_content") else []
        ir_messages.append(
            Message(
                role=m["role"],
                content=parts,
                reasoning=reasoning,
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id"),
                name=m.get("name"),
            )
        )
    ir_tools = [
        Tool(
            name=t["function"]["name"],
            description=t["function"].get("description"),
            parameters=t["function"].get("parameters", {"type": "object", "properties": {}}),
        )
        for t in tools or []
    ]
    return Conversation(messages=ir_messages, tools=ir_tools, thinking=Thinking(enabled=thinking))


def with_dict_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same messages with tool-call arguments as dicts, the form transformers documents."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out
