"""Responses tool declarations: what real agents (Codex CLI, the Agents SDK) send.

- `function`: a function tool. Its `defer_loading` is read as DeepSeek's codec reads it in a
  Responses request: not at all (the tool is listed).
- `namespace`: a group of function tools (Codex puts MCP servers' tools in one). The model sees
  each as one function named `NAMESPACE::NAME`, described by the group's description and its
  own, as DeepSeek's codec writes them; calls are split back into `namespace` + `name`.
- `custom` `apply_patch`: a free-form text tool. The model sees a function with one string
  parameter, `input`, with the client's description (the DeepSeek V4 encodings write their
  codec's own instead: recipe/apply_patch.py); its calls come back as `custom_tool_call` items
  holding that text. Its grammar (`format: {type: grammar}`) is enforced by the sampler when
  the call is forced. Other custom tools are refused, as DeepSeek's codec refuses them.
- Hosted tools the server cannot run (`web_search`, `file_search`, `code_interpreter`, …):
  dropped from the prompt by default, or refused (`hosted_tools="reject"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from deepinfer.recipe.api._request import EMPTY_OBJECT_SCHEMA
from deepinfer.recipe.api._validation import ApiModel, validate
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Tool

HostedTools = Literal["drop", "reject"]
NAMESPACE_SEPARATOR = "::"
CUSTOM_TOOLS = ("apply_patch",)
CUSTOM_INPUT = "input"
CUSTOM_INPUT_DESCRIPTION = (
    "The entire contents of the apply_patch command (the *** Begin Patch ... *** End Patch envelope)."
)


class _FunctionTool(ApiModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamespaceTool(ApiModel):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[dict[str, Any]]


class _CustomFormat(ApiModel):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class _CustomTool(ApiModel):
    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: _CustomFormat | None = None


@dataclass(frozen=True, slots=True)
class CustomGrammar:
    """A custom tool's input grammar, for the sampler."""

    syntax: Literal["lark", "regex"]
    definition: str


@dataclass(slots=True)
class DeclaredTools:
    tools: list[Tool]
    grammars: dict[str, CustomGrammar]  # custom tool name -> its grammar, where it has one
    dropped: list[str]  # the hosted tool types left out of the prompt


def declared_tools(raw_tools: list[Any], hosted: HostedTools) -> DeclaredTools:
    tools: list[Tool] = []
    grammars: dict[str, CustomGrammar] = {}
    dropped: list[str] = []
    for i, raw in enumerate(raw_tools):
        path = f"tools[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "function":
            tools.append(_function(validate(_FunctionTool, raw, path)))
        elif kind == "namespace":
            tools.extend(_namespace(validate(_NamespaceTool, raw, path), path))
        elif kind == "custom":
            spec = validate(_CustomTool, raw, path)
            if spec.name not in CUSTOM_TOOLS:
                raise RecipeError(
                    f"{path}.name: custom tool {spec.name!r} is not supported; the only custom tool is "
                    "'apply_patch' (declare others as function tools)",
                    param=f"{path}.name",
                )
            tools.append(_custom(spec))
            fmt = spec.format
            if fmt is not None and fmt.type == "grammar" and fmt.definition and fmt.syntax:
                grammars[spec.name] = CustomGrammar(fmt.syntax, fmt.definition)
        elif isinstance(kind, str) and kind:
            if hosted == "reject":
                raise RecipeError(
                    f"{path}.type: the hosted tool {kind!r} is not available on this server (it only runs "
                    "the model; function, namespace and custom tools are the client's to run)",
                    param=f"{path}.type",
                )
            dropped.append(kind)
        else:
            raise RecipeError(f"{path}.type: a tool needs a type", param=f"{path}.type")
    return DeclaredTools(tools, grammars, dropped)


def _function(spec: _FunctionTool, namespace: tuple[str, str | None] | None = None) -> Tool:
    parameters = spec.parameters if spec.parameters is not None else dict(EMPTY_OBJECT_SCHEMA)
    if namespace is None:
        return Tool(
            name=spec.name,
            description=spec.description,
            parameters=parameters,
            strict=bool(spec.strict),
        )
    group, about = namespace
    description = spec.description if about is None else f"{about}\n{spec.description or ''}"
    return Tool(
        name=f"{group}{NAMESPACE_SEPARATOR}{spec.name}",
        description=description,
        parameters=parameters,
        strict=bool(spec.strict),
        namespace=group,
        local_name=spec.name,
    )


def _namespace(spec: _NamespaceTool, path: str) -> list[Tool]:
    out = []
    for j, raw in enumerate(spec.tools):
        where = f"{path}.tools[{j}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise RecipeError(
                f"{where}.type: a namespace holds function tools, got {kind!r}", param=f"{where}.type"
            )
        out.append(_function(validate(_FunctionTool, raw, where), (spec.name, spec.description)))
    return out


def _custom(spec: _CustomTool) -> Tool:
    # The client's description; the grammar is not shown, it binds a forced call (CustomGrammar).
    return Tool(
        name=spec.name,
        description=spec.description,
        parameters={
            "type": "object",
            "additionalProperties": False,
            "properties": {CUSTOM_INPUT: {"type": "string", "description": CUSTOM_INPUT_DESCRIPTION}},
            "required": [CUSTOM_INPUT],
        },
        custom=True,
    )


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model knows a (possibly namespaced) function by."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
