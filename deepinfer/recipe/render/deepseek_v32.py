"""DeepSeek-V3.2 native prompt format (DSML tool calls), written from the published encoding.

Rules (each one checked by the official fixture):
- BOS, then every message in order; a user turn is `<｜User｜>…<｜Assistant｜>` followed by
  `<think>` when it is the last user turn and thinking is on, else by `</think>`.
- Tools and the response format are attached to the first system message (an empty one is
  inserted when the conversation has none).
- An assistant turn is `reasoning</think>` (only after the last user turn, in thinking mode),
  then its text, then `\\n\\n<｜DSML｜function_calls>…` when it calls tools, then EOS. Reasoning of
  turns before the last user message is therefore always dropped.
- Tool results follow as one `<function_results>` block per calling turn, then `<think>` or
  `</think>` like a user turn.
- A `developer` message is a user turn whose text is prefixed by "# The user's message is: ".
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, Message, ToolCall
from deepinfer.recipe.render.common import (
    active_tools,
    function_json,
    parse_arguments,
    prepare_messages,
    reasoning_text,
    response_format_json,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_CLOSE = f"</{DSML}parameter>"

TOOLS_SECTION = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_OPEN}" block like the following as part of your reply to the user:
{CALLS_OPEN}
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
<{DSML}invoke name="$FUNCTION_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

{CALLS_OPEN}
...
{CALLS_CLOSE}

<function_results>
...
</function_results>

{THINK_OPEN}...thinking about results{THINK_CLOSE}

Here are the functions available in JSONSchema format:
<functions>
{{functions}}
</functions>
"""

RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class DeepSeekV32Renderer:
    family = "deepseek_v32"

    def __init__(self, *, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def render(self, conv: Conversation) -> str:
        thinking = bool(conv.thinking.enabled)
        messages = prepare_messages(conv)
        header = self._system_header(conv)
        if header and messages[0].role != "system":
            messages = [Message(role="system"), *messages]
        last_user = max((i for i, m in enumerate(messages) if m.role in ("user", "developer")), default=-1)
        parts = [BOS] if self.add_bos else []
        i = 0
        while i < len(messages):
            msg = messages[i]
            if msg.role == "system":
                parts.append(msg.text + (header if i == 0 else ""))
            elif msg.role in ("user", "developer"):
                parts.append(self._user_turn(i, msg))
                parts.append(THINK_OPEN if i == last_user and thinking else THINK_CLOSE)
            elif msg.role == "assistant":
                parts.append(self._assistant_turn(msg, thinking and i > last_user))
            else:
                end = i
                while end < len(messages) and messages[end].role == "tool":
                    end += 1
                results = "".join(f"\n<result>{m.text}</result>" for m in messages[i:end])
                parts.append(f"\n\n<function_results>{results}\n</function_results>")
                parts.append("\n\n" + (THINK_OPEN if end - 1 >= last_user and thinking else THINK_CLOSE))
                i = end
                continue
            i += 1
        return "".join(parts)

    @staticmethod
    def _system_header(conv: Conversation) -> str:
        header = ""
        tools = active_tools(conv)
        if tools:
            functions = "\n".join(to_json(function_json(t)) for t in tools)
            header += "\n\n" + TOOLS_SECTION.replace("{functions}", functions)
        fmt = response_format_json(conv.response_format)
        if fmt is not None:
            header += "\n\n" + RESPONSE_FORMAT_SECTION + to_json(fmt)
        return header

    @staticmethod
    def _user_turn(i: int, msg: Message) -> str:
        if msg.role == "user":
            return f"<｜User｜>{msg.text}<｜Assistant｜>"
        if not msg.text:
            raise RecipeError("a developer message needs text", f"messages[{i}].content")
        return f"<｜User｜>\n\n# The user's message is: {msg.text}<｜Assistant｜>"

    @staticmethod
    def _assistant_turn(msg: Message, with_reasoning: bool) -> str:
        reasoning = reasoning_text(msg) + THINK_CLOSE if with_reasoning else ""
        calls = ""
        if msg.tool_calls:
            invokes = "\n".join(render_invoke(call) for call in msg.tool_calls)
            calls = f"\n\n{CALLS_OPEN}\n{invokes}\n{CALLS_CLOSE}"
        return f"{reasoning}{msg.text}{calls}{EOS}"


def render_invoke(call: ToolCall) -> str:
    """One DSML invoke: strings verbatim (string="true"), anything else as JSON."""
    arguments = parse_arguments(call.arguments, "tool_calls.arguments")
    params = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        params.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{text}{PARAM_CLOSE}'
        )
    body = "\n".join(params)
    return f'<{DSML}invoke name="{call.name}">\n{body}\n{INVOKE_CLOSE}'
