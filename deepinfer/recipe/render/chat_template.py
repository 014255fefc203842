"""Render a conversation with the model's own Jinja chat template (transformers-identical output).

The IR becomes the message dicts transformers documents: text content, tool calls with
`arguments` as a dict (templates apply `tojson`, so passing the raw string would encode it a
second time), reasoning under `reasoning_content` (and `thinking`, as transformers aliases it).

Templates that render calls but no tool list (DeepSeek's) get the tool list of their own syntax
in the system message. Templates that know nothing of tools (SmolLM2's plain ChatML) get
Hermes-style tools instead:
the tool list is appended to the system message, calls are written into the assistant text as
`<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` with the raw argument text, and results
are sent back as a user turn of `<tool_response>` blocks, the layout Qwen2.5 uses natively.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import jinja2

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, Message, Tool
from deepinfer.recipe.render.common import (
    active_tools,
    function_json,
    parse_arguments,
    prepare_messages,
    reasoning_text,
)
from deepinfer.recipe.render.deepseek_v31 import R1_CALL_SYNTAX, V31_CALL_SYNTAX, tools_section
from deepinfer.recipe.render.jinja_env import compile_template

ToolFormat = Literal["dsml", "deepseek_v31", "deepseek_r1", "hermes", "llama3_json"]

HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)

# End-of-turn texts a template may use; the parser stops at any of them that the template writes.
END_OF_TURN_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<｜end▁of▁sentence｜>",
)


@dataclass(frozen=True, slots=True)
class TemplateFeatures:
    """What a chat template can express, read from its source."""

    native_tools: bool  # reads the `tools` variable
    native_tool_calls: bool  # renders `tool_calls` of assistant messages
    tool_format: ToolFormat | None  # how the model writes calls (None: unknown syntax)
    can_think: bool  # the model may open a `<think>` block

    @classmethod
    def of(cls, source: str) -> TemplateFeatures:
        native_tools = re.search(r"\btools\b", source) is not None
        tool_format: ToolFormat | None
        if "<｜tool▁sep｜>" in source:
            tool_format = "deepseek_r1" if "```json" in source else "deepseek_v31"
        elif "<tool_call>" in source or not native_tools:
            tool_format = "hermes"
        elif "<|python_tag|>" in source or '"parameters": ' in source:
            tool_format = "llama3_json"
        else:
            tool_format = None
        return cls(
            native_tools=native_tools,
            native_tool_calls="tool_calls" in source,
            tool_format=tool_format,
            can_think="<think>" in source,
        )


def tool_list_prompt(tool_format: ToolFormat, tools: list[Tool]) -> str:
    """The tool list for templates that do not render `tools`, in the syntax the model calls with."""
    if tool_format == "deepseek_v31":
        return tools_section(tools, V31_CALL_SYNTAX)
    if tool_format == "deepseek_r1":
        return tools_section(tools, R1_CALL_SYNTAX)
    return hermes_tools_prompt(tools)


def hermes_tools_prompt(tools: list[Tool]) -> str:
    listed = "".join(
        "\n" + json.dumps({"type": "function", "function": function_json(t)}, ensure_ascii=False)
        for t in tools
    )
    return HERMES_TOOLS_HEADER + listed + HERMES_TOOLS_FOOTER


def hermes_call_text(name: str, arguments: str) -> str:
    """One Hermes call block; the arguments are the raw JSON text, never re-encoded."""
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments.strip() or "{}"}}}\n</tool_call>'


class ChatTemplateRenderer:
    family = "chat_template"

    def __init__(
        self,
        template: str,
        special_tokens: Mapping[str, Any] | None = None,
        *,
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        self.template = template
        self.special_tokens = dict(special_tokens or {})
        self.features = TemplateFeatures.of(template)
        self._now = now

    def render(
        self,
        conv: Conversation,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        messages = prepare_messages(conv)
        tools = active_tools(conv)
        if tools and self.features.tool_format is None:
            raise RecipeError(
                "this model's chat template uses a tool-call syntax deepinfer cannot parse", param="tools"
            )
        if self.features.native_tool_calls:
            dicts = [native_message(m) for m in messages]
        else:
            dicts = hermes_messages(messages)
        template_tools = None
        if tools and self.features.native_tools:
            template_tools = [{"type": "function", "function": function_json(t)} for t in tools]
        elif tools:
            assert self.features.tool_format is not None
            dicts = with_system_suffix(dicts, tool_list_prompt(self.features.tool_format, tools))
        kwargs: dict[str, Any] = dict(self.special_tokens)
        if conv.thinking.enabled is not None:
            kwargs["enable_thinking"] = conv.thinking.enabled
        kwargs.update(template_kwargs or {})
        try:
            return compile_template(self.template, self._now).render(
                messages=dicts,
                tools=template_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise RecipeError(
                f"the model's chat template rejected the conversation: {exc}", param="messages"
            ) from None


def native_message(msg: Message) -> dict[str, Any]:
    role = "system" if msg.role == "developer" else msg.role
    out: dict[str, Any] = {"role": role, "content": msg.text}
    if msg.role == "tool":
        if msg.tool_call_id is not None:
            out["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": parse_arguments(call.arguments, "tool_calls.arguments"),
                },
            }
            for call in msg.tool_calls
        ]
    reasoning = reasoning_text(msg)
    if reasoning:
        # transformers passes reasoning under both names, `thinking` first and `reasoning_content` last.
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def hermes_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: calls and results written as Hermes text."""
    out: list[dict[str, Any]] = []
    previous_was_result = False
    for msg in messages:
        if msg.role == "tool":
            block = f"<tool_response>\n{msg.text}\n</tool_response>"
            if previous_was_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous_was_result = True
            continue
        previous_was_result = False
        entry = native_message(Message(role=msg.role, content=msg.content, reasoning=msg.reasoning))
        if msg.tool_calls:
            calls = "\n".join(hermes_call_text(c.name, c.arguments) for c in msg.tool_calls)
            entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + calls
        out.append(entry)
    return out


def with_system_suffix(messages: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """Append `suffix` to the leading system message, or add one holding just `suffix`."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{suffix}" if first["content"] else suffix
        return [first, *messages[1:]]
    return [{"role": "system", "content": suffix}, *messages]
