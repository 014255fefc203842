"""Responses items as a response store keeps them: the input items of a request as item
resources (each with an `id`, as `GET /v1/responses/{id}/input_items` lists them), and the
output items of a stored response as the input of the next turn (`previous_response_id`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_ID_PREFIX = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}
_CALLS = ("function_call", "custom_tool_call")


def input_item_resources(value: str | Sequence[dict[str, Any]], id_stem: str) -> list[dict[str, Any]]:
    """A request's (already validated) `input` as item resources: a string is one user message,
    message text becomes content parts, and every item has an id and a status."""
    items = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
    resources = []
    for index, raw in enumerate(items):
        item = {"type": "message", **raw}
        kind = item["type"]
        if kind == "message":
            item["content"] = _content_parts(item["content"], item.get("role"))
        elif kind == "function_call" and not isinstance(item.get("arguments"), str):
            item["arguments"] = json.dumps(item.get("arguments"), ensure_ascii=False)
        elif kind == "reasoning":
            item.setdefault("summary", [])
        if kind != "reasoning":
            item.setdefault("status", "completed")
        if not item.get("id"):
            item = {"id": f"{_ID_PREFIX.get(kind, 'item')}_{id_stem}_in{index}", **item}
        resources.append(item)
    return resources


def _content_parts(content: Any, role: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        if role == "assistant":
            return [{"type": "output_text", "text": content, "annotations": []}]
        return [{"type": "input_text", "text": content}]
    parts = []
    for part in content:
        if part.get("type") == "output_text":
            part = {"annotations": [], **part}
        parts.append(part)
    return parts


def output_as_input(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the next turn's input: everything the model wrote,
    in order, except calls the token limit cut (they were never valid calls)."""
    return [
        item for item in output if not (item.get("type") in _CALLS and item.get("status") == "incomplete")
    ]
