"""DeepSeek-V4 and DeepSeek-V4.1 native prompt formats, written from the behaviour of DeepSeek's
own codec (`deepseek-recipe`), which the tests compare against byte for byte.

Layout: BOS, a system block, then the turns; every user-side turn opens with its marker and the
reply opens with `<｜Assistant｜>` followed by `<think>` (thinking) or `</think>`.

- System block. V4 hoists every system message to the top (joined by a blank line) and writes
  its reasoning-effort preamble before them; V4.1 keeps system messages where they are, each
  its own `<｜System｜>` turn, and the effort (`Reasoning Effort: 50|75|100 …`) opens the first
  one. The tool list and the response format are appended to the first system text (a system
  block is opened for them when the conversation starts without one).
- User-side turns: consecutive user texts, tool results (`<tool_result>…</tool_result>`, in call
  order) and V4's developer messages merge into one `<｜User｜>` turn, joined by a blank line;
  `<｜latest_reminder｜>` turns stand alone.
- Assistant turns: `<think>reasoning</think>` in thinking mode when tools are offered (agent
  loops keep every earlier reasoning), else `</think>`; then the text; then the DSML block
  (`\\n\\n<｜DSML｜tool_calls>` in V4, `\\n\\n<｜DSML｜ calls>` in V4.1); then EOS.
- A last assistant message marked `prefix` is continued: no EOS, and no new reply header.
- A forced tool call (tool_choice required or named, thinking off) opens the DSML block in the
  prompt, so the reply starts inside it.
- Images: V4.1 writes `<｜image｜>` (the engine gets the sources), V4 `[Unsupported Image]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer.recipe.apply_patch import APPLY_PATCH_DESCRIPTION, APPLY_PATCH_DESCRIPTION_V4
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, ImagePart, Message, TextPart, Tool, ToolCall
from deepinfer.recipe.render.common import (
    active_tools,
    call_arguments,
    prepare_messages,
    reasoning_text,
)

Version = Literal["v4", "v41"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
IMAGE = "<｜image｜>"
UNSUPPORTED_IMAGE = "[Unsupported Image]"

# Every marker these renderers write as a special token (the rest of the prompt is text).
MARKERS = (BOS, EOS, THINK_OPEN, THINK_CLOSE, SYSTEM, USER, ASSISTANT, LATEST_REMINDER, DSML, IMAGE)

# V4's reasoning-effort preambles (none for `low`).
V4_HIGH_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
)
V4_MAX_PREAMBLE = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, "
    "and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and "
    "are certain that no assumption remains unchecked and no error remains undiscovered."
)
V41_EFFORT = "Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the reasoning)"

# API effort spellings -> the codec's four levels (None: the model's default).
EFFORT_LEVELS: dict[str, str] = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
_V41_LEVEL = {"low": 50, "high": 75, "xhigh": 75, "max": 100}

RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
V4_JSON_OBJECT_SECTION = "You are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY."

# Output-token defaults when the request sets none (before capping by the context left).
DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_TOKENS_THINKING = 65536
DEFAULT_MAX_TOKENS_THINKING_MAX = 131072


@dataclass(frozen=True, slots=True)
class DsmlSpelling:
    """The DSML tags of one version: V4 `<｜DSML｜tool_calls>`, V4.1 `<｜DSML｜ calls>`."""

    calls: str
    invoke: str
    parameter: str

    @classmethod
    def of(cls, version: Version) -> DsmlSpelling:
        if version == "v4":
            return cls(calls=f"{DSML}tool_calls", invoke=f"{DSML}invoke", parameter=f"{DSML}parameter")
        return cls(calls=f"{DSML} calls", invoke=f"{DSML} invoke", parameter=f"{DSML} parameter")


def tools_section(tags: DsmlSpelling, tools: list[Tool], version: Version = "v41") -> str:
    schemas = "\n".join(tool_schema_json(t, version) for t in tools)
    calls, invoke, param = tags.calls, tags.invoke, tags.parameter
    return (
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
        f'tools by writing a "<{calls}>" block like the following:\n\n'
        f"<{calls}>\n"
        f'<{invoke} name="$TOOL_NAME">\n'
        f'<{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{param}>\n'
        "...\n"
        f"</{invoke}>\n"
        f'<{invoke} name="$TOOL_NAME2">\n'
        "...\n"
        f"</{invoke}>\n"
        f"</{calls}>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types '
        '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        f"### Available Tool Schemas\n\n{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def updated_tools_section(tools: list[Tool]) -> str:
    return "### Updated Tool Schemas\n\n" + "\n".join(tool_schema_json(t) for t in tools)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_schema_json(tool: Tool, version: Version = "v41") -> str:
    parameters = strict_schema(tool.parameters) if tool.strict else tool.parameters
    return to_json(
        {
            "name": shown_name(tool, version),
            "description": shown_description(tool, version),
            "parameters": parameters,
        }
    )


def shown_name(tool: Tool, version: Version) -> str:
    """V4.1 names a namespaced function `NS::NAME` (Tool.name); V4 writes `NS__NAME`."""
    if version == "v4" and tool.namespace is not None and tool.local_name is not None:
        return f"{tool.namespace}__{tool.local_name}"
    return tool.name


def shown_description(tool: Tool, version: Version) -> str:
    """V4.1 describes a namespaced function by its group's description and its own; V4 by its own.
    The `apply_patch` custom tool has each version's own text, whatever the client's description
    (DeepSeek's codec replaces it)."""
    if tool.custom:
        return APPLY_PATCH_DESCRIPTION_V4 if version == "v4" else APPLY_PATCH_DESCRIPTION
    if version == "v4" and tool.namespace is not None and tool.description is not None:
        return tool.description.split("\n", 1)[1] if "\n" in tool.description else tool.description
    return tool.description or ""


def tool_aliases(tools: list[Tool], version: Version) -> dict[str, str]:
    """The names the model calls tools by that differ from Tool.name (V4's namespaced ones)."""
    return {shown_name(t, version): t.name for t in tools if shown_name(t, version) != t.name}


def strict_schema(schema: Any) -> Any:
    """A strict tool's schema as the model is shown it: every object closed to other properties
    and requiring all of its own (OpenAI's strict-mode rules), nested objects included."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k != "properties" else v for k, v in schema.items()}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        out["properties"] = {k: strict_schema(v) for k, v in properties.items()}
    if schema.get("type") == "object":
        out["additionalProperties"] = False
        out["required"] = list(properties) if isinstance(properties, dict) else []
    return out


def response_format_schema(conv: Conversation) -> dict[str, Any] | None:
    fmt = conv.response_format
    if fmt is None or not fmt.in_prompt:
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        return fmt.json_schema or {}
    return None  # regex/choice/grammar: enforced by the sampler alone


def effort_level(conv: Conversation) -> str | None:
    effort = conv.thinking.effort
    return None if effort is None else EFFORT_LEVELS.get(effort)


def thinking_enabled(conv: Conversation) -> bool:
    """Thinking is on unless the request turned it off (V4's default)."""
    return conv.thinking.enabled is not False and conv.thinking.effort != "none"


def forced_call(conv: Conversation) -> bool:
    choice = conv.tool_choice
    if choice.auto_in_prompt:
        return False
    return choice.mode in ("required", "named") and bool(active_tools(conv))


def default_max_tokens(conv: Conversation) -> int:
    if not thinking_enabled(conv):
        return DEFAULT_MAX_TOKENS
    return DEFAULT_MAX_TOKENS_THINKING_MAX if effort_level(conv) == "max" else DEFAULT_MAX_TOKENS_THINKING


def check_request(conv: Conversation, tools: list[Tool]) -> None:
    """The requests DeepSeek's codec refuses, refused the same way."""
    if len({t.strict for t in conv.tools}) > 1:
        raise RecipeError("strict and non-strict tools cannot be mixed in one request", "tools")
    fmt = conv.response_format
    if fmt is not None and fmt.type == "json_object":
        texts = (m.text for m in conv.messages)
        if not any("json" in t.lower() for t in texts):
            raise RecipeError(
                "the prompt must contain the word 'json' to use a response format of type 'json_object'",
                "response_format",
            )
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last.prefix and tools:
        raise RecipeError("tools cannot be combined with an assistant prefix to continue", "tools")
    if last is not None and last.prefix and fmt is not None and fmt.type == "json_object":
        raise RecipeError(
            "a json_object response format cannot be combined with an assistant prefix", "response_format"
        )


def offered_tools(conv: Conversation) -> list[Tool]:
    """The tools the prompt lists: a named tool choice offers that tool alone."""
    tools = active_tools(conv)
    if conv.tool_choice.mode == "named":
        return [t for t in tools if t.name == conv.tool_choice.name]
    return tools


class DeepSeekV4Renderer:
    """One renderer for both versions; `version` picks V4's or V4.1's rules."""

    def __init__(self, version: Version) -> None:
        self.version = version
        self.tags = DsmlSpelling.of(version)
        self.family = "deepseek_v4" if version == "v4" else "deepseek_v41"

    # -- the whole prompt

    def render(self, conv: Conversation) -> str:
        thinking = thinking_enabled(conv)
        if thinking and forced_call(conv):
            raise RecipeError(
                "thinking mode does not support a forced tool call (tool_choice 'required' or a named "
                "tool); turn thinking off for it",
                "tool_choice",
            )
        messages = _prepared(conv)
        tools = offered_tools(conv)
        check_request(conv, tools)
        keep_reasoning = thinking and bool(tools)
        call_names = {t.name: shown_name(t, self.version) for t in conv.tools}
        system_suffix = self._system_suffix(conv, tools)
        parts = [BOS]
        if self.version == "v4":
            parts.append(self._v4_system(conv, messages, thinking, system_suffix))
            messages = [m for m in messages if m.role != "system" or m.in_turns]
        elif messages[0].role in ("system", "developer"):
            parts.append(self._v41_system_head(conv, thinking) + self._system_turn_text(messages[0]))
            parts.append(system_suffix)
            messages = messages[1:]
        else:
            parts.append(self._v41_opening(conv, thinking, system_suffix))
        pending_user: list[str] = []  # user-side texts merging into the next <｜User｜> turn
        for msg in messages:
            role = msg.role
            if role == "developer" and self.version == "v4":
                role = "user"
            if role == "system" and msg.in_turns and self.version == "v4":
                # V4 has no system turn: the codec hands such an entry to the user as a reminder.
                pending_user.append(f"<system-reminder>\n{self._content_text(msg)}\n</system-reminder>")
                continue
            if role in ("user", "tool"):
                pending_user.append(self._user_text(msg) if role == "user" else self._tool_result(msg))
                continue
            if pending_user:
                parts.append(USER + "\n\n".join(pending_user))
                pending_user = []
            if role in ("system", "developer"):
                parts.append(SYSTEM + self._system_turn_text(msg))
            elif role == "latest_reminder":
                parts.append(LATEST_REMINDER + msg.text)
            else:
                parts.append(self._assistant(msg, thinking, keep_reasoning, call_names))
        if pending_user:
            parts.append(USER + "\n\n".join(pending_user))
        last = messages[-1] if messages else None
        if last is None or not last.prefix:
            parts.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE))
            if forced_call(conv):
                parts.append(f"\n\n<{self.tags.calls}>\n")
        return "".join(parts)

    def initial_state(self, conv: Conversation) -> Literal["reasoning", "content", "tool"]:
        """Where the reply starts: in reasoning, in the answer, or inside a forced DSML block."""
        last = conv.messages[-1] if conv.messages else None
        thinking = thinking_enabled(conv)
        if last is not None and last.prefix:
            return "content" if not thinking or last.text else "reasoning"
        if forced_call(conv):
            return "tool"
        return "reasoning" if thinking else "content"

    # -- system block

    def _system_suffix(self, conv: Conversation, tools: list[Tool]) -> str:
        suffix = ""
        listed = [t for t in tools if not t.defer_loading]
        if listed:
            suffix += "\n\n" + tools_section(self.tags, listed, self.version)
        schema = response_format_schema(conv)
        if (
            schema == {"type": "json_object"}
            and conv.response_format
            and conv.response_format.type == "json_object"
        ):
            if self.version == "v4":
                suffix += "\n\n" + V4_JSON_OBJECT_SECTION
            else:
                suffix += "\n\n" + RESPONSE_FORMAT_SECTION + to_json(schema)
        elif schema is not None:
            suffix += "\n\n" + RESPONSE_FORMAT_SECTION + to_json(schema)
        return suffix

    def _v4_system(self, conv: Conversation, messages: list[Message], thinking: bool, suffix: str) -> str:
        texts = [self._content_text(m) for m in messages if m.role == "system" and not m.in_turns]
        block = "\n\n".join(texts) + suffix
        level = effort_level(conv) or "high"
        if thinking and level != "low":
            preamble = V4_MAX_PREAMBLE if level == "max" else V4_HIGH_PREAMBLE
            return f"{preamble}\n\n{block}"
        return block

    def _v41_system_head(self, conv: Conversation, thinking: bool) -> str:
        if not thinking:
            return SYSTEM
        level = _V41_LEVEL[effort_level(conv) or "high"]
        return SYSTEM + V41_EFFORT.format(level=level) + "\n\n"

    def _v41_opening(self, conv: Conversation, thinking: bool, suffix: str) -> str:
        """The first system turn of a conversation that does not start with a system message."""
        if not thinking and not suffix:
            return ""
        return self._v41_system_head(conv, thinking) + suffix

    def _system_turn_text(self, msg: Message) -> str:
        # A V4.1 system turn is written like a user one: parts joined by a blank line, images too.
        text = self._content_text(msg)
        if msg.tools:
            return text + "\n\n" + updated_tools_section(msg.tools)
        return text

    # -- turns

    def _content_text(self, msg: Message) -> str:
        # Parts of one message are joined by a blank line, as separate texts of one turn are.
        image = IMAGE if self.version == "v41" else UNSUPPORTED_IMAGE
        return "\n\n".join(p.text if isinstance(p, TextPart) else image for p in msg.content)

    def _user_text(self, msg: Message) -> str:
        return self._content_text(msg)

    def _tool_result(self, msg: Message) -> str:
        return f"<tool_result>{self._content_text(msg)}</tool_result>"

    def _assistant(
        self, msg: Message, thinking: bool, keep_reasoning: bool, call_names: dict[str, str]
    ) -> str:
        text = msg.text
        if msg.prefix:
            if not thinking:
                return ASSISTANT + THINK_CLOSE + text
            reasoning = reasoning_text(msg)
            return ASSISTANT + THINK_OPEN + reasoning + (THINK_CLOSE + text if text else "")
        head = THINK_OPEN + reasoning_text(msg) + THINK_CLOSE if keep_reasoning else THINK_CLOSE
        calls = ""
        if msg.tool_calls:
            invokes = "\n".join(self._invoke(call, call_names) for call in msg.tool_calls)
            calls = f"\n\n<{self.tags.calls}>\n{invokes}\n</{self.tags.calls}>"
        return ASSISTANT + head + text + calls + EOS

    def _invoke(self, call: ToolCall, call_names: dict[str, str]) -> str:
        arguments = call_arguments(call.arguments)
        param = self.tags.parameter
        params = []
        for key, value in arguments.items():
            is_str = isinstance(value, str)
            shown = value if is_str else to_json(value)
            params.append(f'<{param} name="{key}" string="{"true" if is_str else "false"}">{shown}</{param}>')
        name = call_names.get(call.name, call.name)
        head = f'<{self.tags.invoke} name="{name}">\n'
        if self.version == "v4":
            body = "".join(p + "\n" for p in params)
        else:
            body = "\n".join(params) + "\n"
        return head + body + f"</{self.tags.invoke}>"


def images_of(conv: Conversation) -> list[ImagePart]:
    """The images of a conversation in the order of their placeholders in the prompt (the engine
    receives their sources): tool results are written in the order of their calls, not the
    order they came in, so their images are too."""
    messages = _prepared(conv)
    return [p for m in messages if m.role != "latest_reminder" for p in m.content if isinstance(p, ImagePart)]


def _prepared(conv: Conversation) -> list[Message]:
    """The messages as the encoding writes them: with images, the reminder turn, system entries
    where the client placed them, and tool-call arguments of any text (see call_arguments)."""
    return prepare_messages(
        conv, images=True, extra_roles=("latest_reminder",), system_in_turns=True, any_arguments=True
    )
