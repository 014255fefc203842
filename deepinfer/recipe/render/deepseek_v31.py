"""DeepSeek-V3.1 and DeepSeek-R1 prompt formats, written from their official chat templates.

V3.1 (hybrid thinking): system prompts joined by a blank line, `<｜User｜>…`, and for the reply
`<｜Assistant｜>` followed by `<think>` (thinking) or `</think>` (non-thinking). Tool calls are
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`,
results `<｜tool▁output▁begin｜>…<｜tool▁output▁end｜>`; after results the model continues without a
new assistant header, as in the official template. The tool list is the "## Tools" section of
the V3.1 model card, appended to the system prompt.

R1: `<｜User｜>…`, the reply header `<｜Assistant｜><think>\\n` (R1 always thinks), calls
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{json}\\n```<｜tool▁call▁end｜>` joined by
newlines, results grouped in `<｜tool▁outputs▁begin｜>…<｜tool▁outputs▁end｜>`. The official template
has bugs for one call per turn and for a second round of results; this renderer writes the
well-formed version of the same layout. R1's template has no tool list, so the V3.1-style
section is used with R1's call syntax.

Both families drop the reasoning of earlier assistant turns (their templates render none).
"""

from __future__ import annotations

import json

from deepinfer.recipe.ir import Conversation, Message, Tool
from deepinfer.recipe.render.common import active_tools, prepare_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"

V31_CALL_SYNTAX = f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{CALL_END}{{{{additional_tool_calls}}}}{CALLS_END}"
R1_CALL_SYNTAX = (
    f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}tool_call_name\n```json\ntool_call_arguments\n```{CALL_END}"
    f"{{{{additional_tool_calls}}}}{CALLS_END}"
)


def tools_section(tools: list[Tool], call_syntax: str) -> str:
    lines = ["## Tools\nYou have access to the following tools:\n"]
    for tool in tools:
        lines.append(f"\n### {tool.name}\nDescription: {tool.description or ''}\n\n")
        lines.append(f"Parameters: {json.dumps(tool.parameters)}\n")
    lines.append(f"\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n{call_syntax}\n\n")
    lines.append(
        "Where:\n\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
    )
    return "".join(lines)


def system_prompt(messages: list[Message], conv: Conversation, call_syntax: str) -> str:
    """System and developer texts joined by a blank line, then the tool list."""
    prompt = "\n\n".join(m.text for m in messages if m.role in ("system", "developer"))
    tools = active_tools(conv)
    if tools:
        prompt += ("\n\n" if prompt else "") + tools_section(tools, call_syntax)
    return prompt


def _after_think(content: str) -> str:
    # The templates strip inline reasoning a client left in the content.
    return content.split("</think>", 1)[1] if "</think>" in content else content


class DeepSeekV31Renderer:
    family = "deepseek_v31"

    def render(self, conv: Conversation) -> str:
        thinking = bool(conv.thinking.enabled)
        messages = prepare_messages(conv)
        parts = [BOS, system_prompt(messages, conv, V31_CALL_SYNTAX)]
        last_user = after_tool = False
        for msg in messages:
            if msg.role == "user":
                parts.append(USER + msg.text)
                last_user, after_tool = True, False
            elif msg.role == "assistant":
                if last_user:
                    parts.append(ASSISTANT + "</think>")
                if msg.tool_calls:
                    calls = "".join(
                        f"{CALL_BEGIN}{c.name}{TOOL_SEP}{c.arguments}{CALL_END}" for c in msg.tool_calls
                    )
                    parts.append(f"{msg.text}{CALLS_BEGIN}{calls}{CALLS_END}{EOS}")
                else:
                    parts.append((msg.text if after_tool else _after_think(msg.text)) + EOS)
                last_user = after_tool = False
            elif msg.role == "tool":
                parts.append(f"{OUTPUT_BEGIN}{msg.text}{OUTPUT_END}")
                last_user, after_tool = False, True
        if last_user:
            parts.append(ASSISTANT + ("<think>" if thinking else "</think>"))
        return "".join(parts)


class DeepSeekR1Renderer:
    family = "deepseek_r1"

    def render(self, conv: Conversation) -> str:
        messages = prepare_messages(conv)
        parts = [BOS, system_prompt(messages, conv, R1_CALL_SYNTAX)]
        in_outputs = False
        for msg in messages:
            if msg.role == "tool":
                parts.append(
                    ("\n" if in_outputs else OUTPUTS_BEGIN) + f"{OUTPUT_BEGIN}{msg.text}{OUTPUT_END}"
                )
                in_outputs = True
                continue
            if msg.role == "user":
                parts.append((OUTPUTS_END if in_outputs else "") + USER + msg.text)
            elif msg.role == "assistant":
                # After tool outputs the reply follows the outputs directly, without a header.
                head = OUTPUTS_END if in_outputs else ASSISTANT
                if msg.tool_calls:
                    calls = "\n".join(
                        f"{CALL_BEGIN}function{TOOL_SEP}{c.name}\n```json\n{c.arguments}\n```{CALL_END}"
                        for c in msg.tool_calls
                    )
                    parts.append(f"{head}{msg.text}{CALLS_BEGIN}{calls}{CALLS_END}{EOS}")
                else:
                    parts.append(head + _after_think(msg.text) + EOS)
            else:
                continue
            in_outputs = False
        # As in the official template: after tool outputs the model continues right away.
        parts.append(OUTPUTS_END if in_outputs else ASSISTANT + "<think>\n")
        return "".join(parts)
