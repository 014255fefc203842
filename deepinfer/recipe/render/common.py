"""Validation and normalisation every renderer runs before it writes a prompt.

One place decides what a well-formed conversation is, so every family rejects the same inputs
with the same `RecipeError` (and the same `param` path), and every family sees tool results
in the order of the calls that produced them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, ImagePart, Message, ResponseFormat, TextPart, Tool

ROLES = ("system", "developer", "user", "assistant", "tool")
# Turn kinds only some encodings have (DeepSeek V4's reminder turn).
EXTRA_ROLES = ("latest_reminder",)


def prepare_messages(
    conv: Conversation,
    *,
    images: bool = False,
    extra_roles: tuple[str, ...] = (),
    system_in_turns: bool = False,
    any_arguments: bool = False,
) -> list[Message]:
    """Validate `conv` and return its messages with every tool-result group in call order.

    `images`: the encoding has an image placeholder; `extra_roles`: roles it knows beyond ROLES;
    `system_in_turns`: the encoding writes system messages the client placed among the turns
    (`Message.in_turns`) where they stand; otherwise they are merged into the system prompt.
    `any_arguments`: the encoding can write tool-call arguments that are not a JSON object
    (`call_arguments`); otherwise they are refused.
    """
    messages = conv.messages
    if not messages:
        raise RecipeError("the conversation has no messages", param="messages")
    for i, msg in enumerate(messages):
        _check_message(i, msg, images=images, roles=ROLES + extra_roles, any_arguments=any_arguments)
        if msg.prefix and (msg.role != "assistant" or i != len(messages) - 1):
            raise RecipeError(
                "only the last message, an assistant message, can be a prefix to continue",
                f"messages[{i}].prefix",
            )
    _check_tools(conv)
    out: list[Message] = []
    merged: list[Message] = []  # system messages among the turns, for the system prompt
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg.role == "system" and msg.in_turns and not system_in_turns:
            merged.append(msg)
            i += 1
            continue
        if msg.role == "tool":
            raise RecipeError(
                "a tool result must follow the assistant message whose tool call it answers",
                param=f"messages[{i}]",
            )
        out.append(msg)
        i += 1
        if msg.role == "assistant" and msg.tool_calls:
            end = i
            while end < len(messages) and messages[end].role == "tool":
                end += 1
            out.extend(_ordered_results(i - 1, msg, messages, i, end))
            i = end
    return _with_merged_system(out, merged) if merged else out


def _with_merged_system(messages: list[Message], merged: list[Message]) -> list[Message]:
    """`merged` appended, in order, to the leading system message (one is opened if there is
    none), as Anthropic's API reads system entries among the turns. Each entry is one text
    block of the prompt, so they are joined by a blank line; they carry text only (images
    were refused above for encodings that would merge them)."""
    lead = messages[0] if messages and messages[0].role == "system" else None
    texts = [m.text for m in ([lead] if lead else []) + merged if m.text]
    system = Message(role="system", content=[TextPart("\n\n".join(texts))])
    return [system, *(messages[1:] if lead else messages)]


def _check_message(
    i: int, msg: Message, *, images: bool, roles: tuple[str, ...], any_arguments: bool
) -> None:
    if msg.role not in roles:
        raise RecipeError(
            f"unknown role {msg.role!r} for this model; expected one of {', '.join(roles)}",
            f"messages[{i}].role",
        )
    for k, part in enumerate(msg.content):
        if isinstance(part, ImagePart) and not images:
            raise RecipeError(
                "images are not supported: this engine serves text models", f"messages[{i}].content[{k}]"
            )
    if msg.tool_calls and msg.role != "assistant":
        raise RecipeError(f"a {msg.role} message cannot carry tool calls", f"messages[{i}].tool_calls")
    seen: set[str] = set()
    for j, call in enumerate(msg.tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not call.name:
            raise RecipeError("a tool call needs a function name", f"{where}.name")
        if call.id in seen:
            raise RecipeError(f"duplicate tool call id {call.id!r}", f"{where}.id")
        seen.add(call.id)
        if not any_arguments:
            parse_arguments(call.arguments, f"{where}.arguments")


def _check_tools(conv: Conversation) -> None:
    names: set[str] = set()
    for k, tool in enumerate(conv.tools):
        if not tool.name:
            raise RecipeError("a tool needs a name", f"tools[{k}].name")
        if tool.name in names:
            raise RecipeError(f"duplicate tool name {tool.name!r}", f"tools[{k}].name")
        names.add(tool.name)
    choice = conv.tool_choice
    if choice.mode == "named" and choice.name not in names:
        raise RecipeError(f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice")
    if choice.mode == "required" and not names:
        raise RecipeError("tool_choice is 'required' but no tools were given", "tool_choice")


def _ordered_results(
    call_index: int, assistant: Message, messages: list[Message], start: int, end: int
) -> list[Message]:
    """The tool results in messages[start:end], matched to `assistant`'s calls and put in call order."""
    calls = assistant.tool_calls
    by_id = {call.id: pos for pos, call in enumerate(calls)}
    slots: list[Message | None] = [None] * len(calls)
    for i in range(start, end):
        result = messages[i]
        if result.tool_call_id is None:
            # No id (some clients omit it): the result answers the first call still unanswered.
            pos = next((p for p, slot in enumerate(slots) if slot is None), None)
            if pos is None:
                raise RecipeError(
                    f"message {call_index} made {len(calls)} tool call(s) but more results follow",
                    f"messages[{i}]",
                )
        elif result.tool_call_id not in by_id:
            raise RecipeError(
                f"tool result for unknown call id {result.tool_call_id!r}: message {call_index} "
                f"made calls {[c.id for c in calls]}",
                f"messages[{i}].tool_call_id",
            )
        else:
            pos = by_id[result.tool_call_id]
            if slots[pos] is not None:
                raise RecipeError(
                    f"two results for tool call {result.tool_call_id!r}", f"messages[{i}].tool_call_id"
                )
        slots[pos] = result if result.name else replace(result, name=calls[pos].name)
    missing = [calls[p].id for p, slot in enumerate(slots) if slot is None]
    # A conversation may stop right after the calls (nothing answered yet); anything else must
    # answer every call, or the model would see a call that silently went nowhere.
    if missing and (start != end or end < len(messages)):
        raise RecipeError(
            f"message {call_index} made {len(calls)} tool call(s) but {end - start} result(s) follow; "
            f"missing results for {missing}",
            f"messages[{call_index}].tool_calls",
        )
    return [slot for slot in slots if slot is not None]


def parse_arguments(raw: str, param: str) -> dict[str, Any]:
    """The JSON object in a tool call's raw argument text."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise RecipeError(f"tool call arguments are not valid JSON: {exc.msg}", param) from None
    if not isinstance(value, dict):
        raise RecipeError("tool call arguments must be a JSON object", param)
    return value


def call_arguments(raw: str) -> dict[str, Any]:
    """A past tool call's arguments for an encoding that can write any text: the JSON object, or
    else (malformed JSON, which a model does emit now and then, another JSON value, or nothing)
    the text as it came, as one string argument named `arguments`, as DeepSeek's codec writes
    it. OpenAI's API takes any string there, so the history stays sendable."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"arguments": raw}


def reasoning_text(msg: Message) -> str:
    """An assistant turn's reasoning as one string (separate items joined by a newline)."""
    return "\n".join(r.text for r in msg.reasoning if r.text)


def active_tools(conv: Conversation) -> list[Tool]:
    """The tools the model is told about: none when tool_choice is 'none'."""
    return [] if conv.tool_choice.mode == "none" else list(conv.tools)


def function_json(tool: Tool) -> dict[str, Any]:
    """OpenAI's `function` object for a tool (name, description when given, parameters)."""
    out: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out


def response_format_json(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """OpenAI's `response_format` object, for families that describe it in the prompt.

    Only JSON formats are described; regex/choice/grammar are enforced by the sampler alone.
    """
    if fmt is None or fmt.type == "json_object":
        return None if fmt is None else {"type": "json_object"}
    if fmt.type != "json_schema":
        return None
    schema: dict[str, Any] = {}
    if fmt.name is not None:
        schema["name"] = fmt.name
    schema["schema"] = fmt.json_schema or {}
    if fmt.strict:
        schema["strict"] = True
    return {"type": "json_schema", "json_schema": schema}
