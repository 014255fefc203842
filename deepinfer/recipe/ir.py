"""The conversation IR: what every API format is parsed into and every renderer reads.

Plain data only (no pydantic, no torch), so the recipe can be reused by another server.
Tool-call arguments are kept as the raw JSON text the model produced or the client sent:
re-encoding a dict would change bytes (key order, spacing) and break prompt reproducibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]

# Reasoning effort as the APIs spell it (Chat `reasoning_effort`, Responses `reasoning.effort`,
# Messages `output_config.effort`); each renderer maps it onto its model's levels.
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


@dataclass(slots=True)
class TextPart:
    text: str


@dataclass(slots=True)
class ImagePart:
    """An image: renderers that know images write a placeholder and carry the source to the
    engine (RenderedPrompt.images); the others reject it.

    `url` is a `data:` URL (checked when parsed) or an http(s) URL (fetched only when the
    server allows it); `detail` is the client's (`low`, `high`, `auto`, `original`; None: not
    given); `path` is where the part stands in the request (`messages[0].content[1]`), so a
    failure later (fetching, decoding) names it."""

    url: str | None = None
    media_type: str | None = None
    detail: str | None = None
    path: str | None = None


ContentPart = TextPart | ImagePart


@dataclass(slots=True)
class Reasoning:
    """One reasoning item of an assistant turn (Anthropic thinking / OpenAI reasoning)."""

    text: str = ""
    signature: str | None = None
    redacted_data: str | None = None


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # raw JSON text, never re-encoded


@dataclass(slots=True)
class Tool:
    """A function the model may call. `defer_loading`: declared but not listed in the prompt until
    loaded; `namespace` (Responses): the group the client declared it in, whose name prefixes
    `name` for the model and is split off again in the output."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False
    defer_loading: bool = False
    namespace: str | None = None
    local_name: str | None = None  # the name inside `namespace`
    custom: bool = False  # a Responses custom tool (free-form text input, e.g. apply_patch)


@dataclass(slots=True)
class Message:
    """One turn. A `tool` message carries the result of the call named by `tool_call_id`.

    `prefix` (the last assistant message only): the reply continues this text instead of
    starting a new turn. `tools` (system messages after the first turn): tool schemas loaded
    on the way (tool search), which DeepSeek V4.1 announces in place. `in_turns` (system
    messages): the client placed it among the turns (an Anthropic Messages `system` entry, such
    as Claude Code's environment block); encodings without system turns merge it into the
    system prompt, DeepSeek's place it as their codec does.
    """

    role: Role
    content: list[ContentPart] = field(default_factory=list)
    reasoning: list[Reasoning] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # tool name for tool results, when the API gives it
    is_error: bool = False  # tool results only
    prefix: bool = False
    tools: list[Tool] = field(default_factory=list)
    in_turns: bool = False

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


@dataclass(slots=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # set when mode == "named"
    # Anthropic's `any`: DeepSeek's codec writes it as `auto` (no opened tool block, allowed in
    # thinking mode); the sampler still forces a call.
    auto_in_prompt: bool = False


@dataclass(slots=True)
class Thinking:
    """enabled=None means the model's own default; effort=None likewise."""

    enabled: bool | None = None
    budget_tokens: int | None = None
    effort: Effort | None = None


@dataclass(slots=True)
class ResponseFormat:
    """Structured output requested by the client."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"] = "text"
    json_schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    in_prompt: bool = True  # whether encodings that describe the format in the prompt do so


@dataclass(slots=True)
class GenerationParams:
    """Sampling and stopping fields, in the engine's terms (None = engine default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class Conversation:
    messages: list[Message] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    thinking: Thinking = field(default_factory=Thinking)
    params: GenerationParams = field(default_factory=GenerationParams)
    response_format: ResponseFormat | None = None
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    cache_salt: str | None = None
    traffic_class: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # Responses: a routing hint, kept for the router
