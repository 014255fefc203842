"""Grammars that force a well-formed tool call in the model's own syntax (tool_choice
`required` or a named tool), with arguments valid against the tool's JSON Schema.

Formats (kept byte-identical to the recipe's parsers in deepinfer/recipe/parse/):
- "hermes" (Hermes/Qwen, and the default SmolLM2 model):
      <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>
  several calls are separated by "\\n".
- "dsml" (DeepSeek-V3.2):
      <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
      <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>\\n ...
      </｜DSML｜invoke>\\n</｜DSML｜function_calls>
  A string parameter is raw text (string="true"); anything else is JSON (string="false").
- "dsml_v4" / "dsml_v41" (DeepSeek-V4 / V4.1): the same with `tool_calls` / ` calls` as the
  block and, in V4.1, a space after `｜DSML｜` in every tag. With `opened`, the prompt already
  wrote the block's opening (a forced call in V4), and the grammar starts at the first invoke.
  Parameters follow the schema's `properties` order; required ones are always present.

The result is a `GrammarSpec` of kind "grammar" in llguidance's Lark dialect (it embeds the
argument schemas with `%json`), so it needs the llguidance backend.

The syntaxes are one table (`register_tool_call_grammar` adds one): the structured-output hook
of every model family whose encoding writes that syntax; `forceable_tool_formats()` is what the
server accepts a forced call for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any, Literal, Protocol

import llguidance

from deepinfer.structured.errors import GrammarError
from deepinfer.structured.json_schema import json_format_options, prepare_schema
from deepinfer.structured.lark import lark_literal, lark_string, regex_escape, rule_name
from deepinfer.structured.spec import GrammarSpec

ToolCallFormat = Literal["hermes", "dsml", "dsml_v4", "dsml_v41"]

DSML = "｜DSML｜"
# (block, invoke, parameter) tag names per DSML format.
DSML_TAGS = {
    "dsml": (f"{DSML}function_calls", f"{DSML}invoke", f"{DSML}parameter"),
    "dsml_v4": (f"{DSML}tool_calls", f"{DSML}invoke", f"{DSML}parameter"),
    "dsml_v41": (f"{DSML} calls", f"{DSML} invoke", f"{DSML} parameter"),
}
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"

# Raw-text shapes for `format` of string parameters in DSML, each a subset of what the format
# allows (e.g. no February 29th), so every value is valid. Other formats fall back to a JSON
# string with string="false", which the parser also reads as a string.
_FORMAT_REGEX = {
    "date": r"[12][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    "email": r"[A-Za-z0-9._%+\-]{1,64}@[A-Za-z0-9\-]{1,63}(?:\.[A-Za-z0-9\-]{1,63}){1,4}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
}
_FORMAT_REGEX["date-time"] = _FORMAT_REGEX["date"] + "T" + _FORMAT_REGEX["time"]

# Keywords of a string schema the raw-text path understands; any other keyword means JSON.
_RAW_STRING_KEYWORDS = {"type", "enum", "const", "pattern", "minLength", "maxLength", "format"}
_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
}


class ToolLike(Protocol):
    """`deepinfer.recipe.ir.Tool` or anything with a name and a parameters schema."""

    name: str
    parameters: dict[str, Any]


def tool_call_spec(
    tools: Sequence[ToolLike],
    fmt: ToolCallFormat,
    *,
    name: str | None = None,
    parallel: bool = True,
    special_tokens: Collection[str] = (),
    after_reasoning: str | None = None,
    opened: bool = False,
) -> GrammarSpec:
    """The constraint for tool_choice `required` (`name=None`: any of `tools`) or a named tool.

    `parallel`: allow several calls (tool_choice `required`); a named choice makes exactly one.
    `special_tokens`: the tokenizer's special-token texts (`TokenizerInfo.special_tokens`), so a
    delimiter that is one token in the model's vocabulary is matched as that token.
    `after_reasoning`: the thinking-section end marker for reasoning models, if the model thinks.
    """
    if not tools:
        raise _error("tools", "tool_choice requires a tool call, but no tools were given")
    if name is not None:
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise _error("tool_choice", f"names the tool {name!r}, which is not among the request's tools")
        tools, parallel = chosen, False
    names = [t.name for t in tools]
    for tool_name in names:
        if not tool_name or any(c in tool_name for c in '"<>\n'):
            raise _error(
                "tools",
                f'tool name {tool_name!r} cannot appear in a tool call (empty or has ", <, > or newline)',
            )
    build = _GRAMMARS.get(fmt)
    if build is None:
        raise _error("tools", f"unknown tool-call format {fmt!r}")
    text = build(tools, parallel, special_tokens, opened)
    spec = GrammarSpec.grammar(text, param="tools")
    return spec.with_reasoning(after_reasoning) if after_reasoning else spec


def _hermes(tools: Sequence[ToolLike], parallel: bool, special: Collection[str], opened: bool) -> str:
    # `opened` never holds here: no prompt writes the opening of a Hermes block.
    lines = []
    alternatives = []
    for i, tool in enumerate(tools):
        rule = rule_name("tool", i, tool.name)
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        lines.append(f"{rule}: {lark_string(head)} {rule}_args {lark_string('}')}")
        lines.append(f"{rule}_args: %json {_inline_schema(tool.parameters)}")
        alternatives.append(rule)
    block = f"{lark_literal(HERMES_OPEN, special)} {lark_string(chr(10))} call {lark_string(chr(10))} {lark_literal(HERMES_CLOSE, special)}"
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return "\n".join([start, f"block: {block}", f"call: {' | '.join(alternatives)}", *lines]) + "\n"


def _dsml(
    tags: tuple[str, str, str],
    tools: Sequence[ToolLike],
    parallel: bool,
    special: Collection[str],
    opened: bool,
) -> str:
    block, invoke, parameter = tags
    calls_open, calls_close = f"<{block}>", f"</{block}>"
    invoke_close, param_close_text = f"</{invoke}>", f"</{parameter}>"
    # DeepSeek puts a blank line between `</think>` and the block; allow up to that.
    head = "" if opened else f'LEAD? {lark_literal(calls_open, special)} "\\n" '
    lines = [
        f"start: {head}{'invoke+' if parallel else 'invoke'} {lark_literal(calls_close, special)}",
        "LEAD: /\\n{1,2}/",
    ]
    alternatives = []
    param_close = lark_literal(param_close_text, special)
    for i, tool in enumerate(tools):
        rule = rule_name("invoke", i, tool.name)
        alternatives.append(rule)
        schema = tool.parameters or {}
        properties: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        params = []
        for j, (key, sub) in enumerate(properties.items()):
            if not key or any(c in key for c in '"<>\n'):
                raise _error("tools", f"parameter name {key!r} of tool {tool.name!r} cannot appear in DSML")
            prule = f"{rule}_p{j}"
            head = f'<{parameter} name="{key}" string="'
            raw = _raw_string_regex(sub if isinstance(sub, dict) else {})
            if raw is not None:
                # One terminal for value + closing tag: the value cannot contain the tag, so the
                # terminal ends exactly at the first tag (a separate tag lexeme would lose to the
                # value's greedy match).
                value_rule = f"{prule}_VALUE".upper()
                no_close = f"~/(?s:.*){regex_escape(param_close_text)}(?s:.*)/"
                lines.append(f"{value_rule}: ({raw} & {no_close}) {lark_string(param_close_text)}")
                body = f'{lark_literal(head, special)} "true\\">" {value_rule} "\\n"'
            else:
                lines.append(f"{prule}_json: %json {_inline_schema(sub if isinstance(sub, dict) else {})}")
                body = f'{lark_literal(head, special)} "false\\">" {prule}_json {param_close} "\\n"'
            lines.append(f"{prule}: {body}")
            params.append(prule if key in required else f"{prule}?")
        missing = required - set(properties)
        if missing:
            raise _error(
                "tools",
                f"tool {tool.name!r} requires parameters {sorted(missing)} that its schema does not define",
            )
        invoke_head = f'<{invoke} name="{tool.name}">\n'
        lines.append(
            f"{rule}: {lark_literal(invoke_head, special)} {' '.join(params)} "
            f'{lark_literal(invoke_close, special)} "\\n"'
        )
    lines.insert(2, f"invoke: {' | '.join(alternatives)}")
    return "\n".join(lines) + "\n"


# (tools, parallel, special tokens, opened) -> the Lark grammar of a forced call, per syntax.
GrammarBuilder = Callable[[Sequence[ToolLike], bool, Collection[str], bool], str]
_GRAMMARS: dict[str, GrammarBuilder] = {
    "hermes": _hermes,
    **{fmt: partial(_dsml, tags) for fmt, tags in DSML_TAGS.items()},
}


def register_tool_call_grammar(fmt: str, build: GrammarBuilder) -> None:
    """Make calls in the syntax `fmt` forceable with `build`'s grammar (mutates the table); a
    ValueError when the syntax has one already."""
    if fmt in _GRAMMARS:
        raise ValueError(f"the tool-call syntax {fmt!r} has a grammar already")
    _GRAMMARS[fmt] = build


def forceable_tool_formats() -> tuple[str, ...]:
    """The tool-call syntaxes a call can be forced in, in registration order."""
    return tuple(_GRAMMARS)


def _raw_string_regex(schema: dict[str, Any]) -> str | None:
    """A Lark terminal expression for the raw text of a string parameter, or None to use JSON."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if schema.get("type", "string") != "string" or not all(isinstance(v, str) for v in values):
            return None
        return "(" + " | ".join(lark_string(v) for v in values) + ")" if values else None
    if schema.get("type") != "string" or set(schema) - _RAW_STRING_KEYWORDS - _ANNOTATIONS:
        return None
    parts = []
    fmt = schema.get("format")
    if fmt is not None:
        if fmt not in _FORMAT_REGEX:
            return None
        parts.append(f"/{_FORMAT_REGEX[fmt]}/")
    pattern = schema.get("pattern")
    if pattern is not None:
        anchored = _anchored_pattern(pattern)
        if anchored is None:
            return None
        parts.append(f"/{anchored}/")
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None or high is not None:
        parts.append(f"/(?s:.){{{int(low or 0)},{'' if high is None else int(high)}}}/")
    return " & ".join(parts) if parts else "/(?s:.*)/"


def _anchored_pattern(pattern: str) -> str | None:
    """A JSON Schema pattern (a search, ECMA-style classes) as a whole-string regex, when simple."""
    body = pattern
    start = body.startswith("^")
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[1 if start else 0 : len(body) - 1 if end else len(body)]
    if "^" in body.replace("[^", "") or "$" in body.replace("\\$", ""):
        return None  # anchors inside alternations: leave it to the JSON path
    body = llguidance.regex_to_lark(f"(?:{body})", "dw")
    return ("" if start else "(?s:.*)") + body + ("" if end else "(?s:.*)")


def _inline_schema(schema: dict[str, Any] | None) -> str:
    """A schema for `%json`, with the server's bounded-whitespace settings."""
    schema = prepare_schema(dict(schema or {"type": "object"}))
    schema["x-guidance"] = json_format_options()
    return json.dumps(schema, ensure_ascii=False)


def _error(param: str, message: str) -> Exception:
    return GrammarError("invalid", f"{param}: {message}", param=param).to_exception()
