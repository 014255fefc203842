"""Anthropic Messages requests: the request body (and count_tokens body) -> Conversation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from deepinfer.recipe.api._request import (
    EngineExtensions,
    ReasoningEffort,
    ToolCallLedger,
    arguments_text,
    check_min_tokens,
    image_part,
)
from deepinfer.recipe.api._validation import ApiModel, require, validate
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import (
    ContentPart,
    Conversation,
    GenerationParams,
    ImagePart,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)

# The API's own floor for manual extended thinking.
MIN_THINKING_BUDGET = 1024

# ---------------------------------------------------------------- request models


class _MessageIn(ApiModel):
    # `system` among the turns is not in Anthropic's schema, but its API takes it and Claude
    # Code sends its environment block that way.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class _TextBlock(ApiModel):
    text: str


_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's list


class _ImageSource(ApiModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class _ImageBlock(ApiModel):
    source: _ImageSource


class _ThinkingBlock(ApiModel):
    thinking: str
    signature: str | None = None


class _RedactedThinkingBlock(ApiModel):
    data: str


class _ToolUseBlock(ApiModel):
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] | str


class _ToolResultBlock(ApiModel):
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class _ToolIn(ApiModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class _ToolChoiceIn(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _ThinkingIn(ApiModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _Metadata(ApiModel):
    user_id: str | None = None


class _OutputFormat(ApiModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _OutputConfig(ApiModel):
    format: _OutputFormat | None = None
    effort: ReasoningEffort | None = None


class CountTokensRequest(EngineExtensions):
    """The request body of POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: _ToolChoiceIn | None = None
    thinking: _ThinkingIn | None = None
    output_config: _OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """The request body of POST /v1/messages (fields the engine uses; others ignored)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    metadata: _Metadata | None = None
    stream: bool | None = None


# ---------------------------------------------------------------- request -> Conversation


def messages_to_conversation(body: Any) -> Conversation:
    """Validate a raw Messages body and turn it into the Conversation IR."""
    request = validate(MessagesRequest, body)
    conversation = _conversation(request, max_tokens=request.max_tokens)
    check_min_tokens(request.min_tokens, request.max_tokens)
    stop = request.stop_sequences or []
    for j, sequence in enumerate(stop):
        require(sequence != "", "stop sequences must not be empty", f"stop_sequences[{j}]")
    conversation.params = GenerationParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=list(stop),
        **request.extension_params(),
    )
    conversation.stream = bool(request.stream)
    conversation.user = request.metadata.user_id if request.metadata else None
    return conversation


def count_tokens_to_conversation(body: Any) -> Conversation:
    """Validate a count_tokens body; the Conversation renders to the prompt whose size is asked."""
    request = validate(CountTokensRequest, body)
    return _conversation(request, max_tokens=None)


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


def _conversation(request: CountTokensRequest, max_tokens: int | None) -> Conversation:
    tools = [_tool(i, raw) for i, raw in enumerate(request.tools or [])]
    messages = _system(request.system)
    ledger = ToolCallLedger()
    for i, raw in enumerate(request.messages):
        messages.extend(_turn(i, raw, ledger))
    response_format = None
    if request.output_config and request.output_config.format:
        # Enforced by the sampler; DeepSeek's codec does not describe it in the prompt either.
        response_format = ResponseFormat(
            type="json_schema", json_schema=request.output_config.format.schema_, in_prompt=False
        )
    return Conversation(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        thinking=_thinking(request.thinking, max_tokens, request.output_config),
        response_format=response_format,
        model=request.model,
        cache_salt=request.cache_salt,
        traffic_class=request.traffic_class,
    )


def _system(system: str | list[dict[str, Any]] | None) -> list[Message]:
    if system is None:
        return []
    parts = _system_parts(system, "system")
    return [Message(role="system", content=parts)] if parts else []


def _system_parts(system: str | list[dict[str, Any]], path: str) -> list[ContentPart]:
    if isinstance(system, str):
        return [TextPart(system)] if system else []
    parts: list[ContentPart] = []
    for j, raw in enumerate(system):
        where = f"{path}[{j}]"
        require(raw.get("type") == "text", "system blocks must be text blocks", f"{where}.type")
        parts.append(TextPart(validate(_TextBlock, raw, where).text))
    return parts


def _tool(index: int, raw: Any) -> Tool:
    path = f"tools[{index}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in (None, "custom"):
        raise RecipeError(f"{path}.type: server tool {kind!r} is not supported", param=f"{path}.type")
    spec = validate(_ToolIn, raw, path)
    require(
        spec.input_schema.get("type") == "object",
        "must be a JSON schema of type 'object'",
        f"{path}.input_schema",
    )
    return Tool(name=spec.name, description=spec.description, parameters=spec.input_schema)


def _tool_choice(spec: _ToolChoiceIn | None, tools: list[Tool]) -> ToolChoice:
    # disable_parallel_tool_use is accepted: the engine's parsers already handle one call or many.
    if spec is None or spec.type == "auto":
        return ToolChoice()
    if spec.type == "none":
        return ToolChoice(mode="none")
    require(bool(tools), f"{spec.type!r} needs at least one tool", "tool_choice.type")
    if spec.type == "any":
        return ToolChoice(mode="required", auto_in_prompt=True)
    require(spec.name is not None, "is required when type is 'tool'", "tool_choice.name")
    require(
        any(t.name == spec.name for t in tools),
        f"names {spec.name!r}, which is not in tools",
        "tool_choice.name",
    )
    return ToolChoice(mode="named", name=spec.name)


def _thinking(spec: _ThinkingIn | None, max_tokens: int | None, config: _OutputConfig | None) -> Thinking:
    """`thinking` turns thinking on or off; `output_config.effort` sets its level (and `none`
    turns it off, as the other APIs' effort fields do)."""
    effort = config.effort if config is not None else None
    if spec is None:
        return Thinking(enabled=False if effort == "none" else None, effort=effort)
    if spec.type == "disabled":
        return Thinking(enabled=False)
    if spec.type == "adaptive":
        return Thinking(enabled=effort != "none", effort=effort)
    budget = spec.budget_tokens
    require(budget is not None, "is required when thinking is enabled", "thinking.budget_tokens")
    assert budget is not None
    require(
        budget >= MIN_THINKING_BUDGET, f"must be at least {MIN_THINKING_BUDGET}", "thinking.budget_tokens"
    )
    if max_tokens is not None:
        require(budget < max_tokens, "must be less than max_tokens", "thinking.budget_tokens")
    return Thinking(enabled=True, budget_tokens=budget, effort=effort if effort != "none" else None)


def _image(raw: dict[str, Any], path: str) -> ImagePart:
    source = validate(_ImageBlock, raw, path).source
    if source.type == "url":
        require(bool(source.url), "is required for a url image", f"{path}.source.url")
        require(not (source.url or "").startswith("data:"), "must be an http(s) URL", f"{path}.source.url")
        return image_part(source.url or "", None, path, f"{path}.source.url")
    require(bool(source.data), "is required for a base64 image", f"{path}.source.data")
    require(bool(source.media_type), "is required for a base64 image", f"{path}.source.media_type")
    require(
        source.media_type in _MEDIA_TYPES,
        f"must be one of {', '.join(_MEDIA_TYPES)}",
        f"{path}.source.media_type",
    )
    url = f"data:{source.media_type};base64,{source.data}"
    return image_part(url, None, path, f"{path}.source.data")


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _turn(index: int, raw: Any, ledger: ToolCallLedger) -> list[Message]:
    path = f"messages[{index}]"
    message = validate(_MessageIn, raw, path)
    require(bool(message.content), "all messages must have non-empty content", f"{path}.content")
    if message.role == "assistant":
        return [_assistant(message.content, path, ledger)]
    if message.role == "system":
        parts = _system_parts(message.content, f"{path}.content")
        return [Message(role="system", content=parts, in_turns=True)]
    # A user turn's tool_result blocks become tool messages, in order, between its other parts.
    turns: list[Message] = []
    pending: list[ContentPart] = []
    for j, block in enumerate(_blocks(message.content)):
        where = f"{path}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            pending.append(TextPart(validate(_TextBlock, block, where).text))
        elif kind == "image":
            pending.append(_image(block, where))
        elif kind == "tool_result":
            if pending:
                turns.append(Message(role="user", content=pending))
                pending = []
            turns.append(_tool_result(block, where, ledger))
        else:
            raise RecipeError(
                f"{where}.type: block {kind!r} is not supported in a user message", param=f"{where}.type"
            )
    if pending or not turns:
        turns.append(Message(role="user", content=pending))
    return turns


def _tool_result(block: dict[str, Any], path: str, ledger: ToolCallLedger) -> Message:
    result = validate(_ToolResultBlock, block, path)
    name = ledger.name_of(result.tool_use_id, f"{path}.tool_use_id")
    parts: list[ContentPart] = []
    content = result.content if result.content is not None else []
    for j, inner in enumerate(_blocks(content)):
        where = f"{path}.content[{j}]"
        kind = inner.get("type")
        if kind == "text":
            parts.append(TextPart(validate(_TextBlock, inner, where).text))
        elif kind == "image":
            parts.append(_image(inner, where))
        else:
            raise RecipeError(
                f"{where}.type: block {kind!r} is not supported in a tool result", param=f"{where}.type"
            )
    return Message(
        role="tool", content=parts, tool_call_id=result.tool_use_id, name=name, is_error=bool(result.is_error)
    )


def _assistant(content: str | list[dict[str, Any]], path: str, ledger: ToolCallLedger) -> Message:
    turn = Message(role="assistant")
    for j, block in enumerate(_blocks(content)):
        where = f"{path}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            turn.content.append(TextPart(validate(_TextBlock, block, where).text))
        elif kind == "thinking":
            thinking = validate(_ThinkingBlock, block, where)
            turn.reasoning.append(Reasoning(text=thinking.thinking, signature=thinking.signature))
        elif kind == "redacted_thinking":
            turn.reasoning.append(
                Reasoning(redacted_data=validate(_RedactedThinkingBlock, block, where).data)
            )
        elif kind == "tool_use":
            use = validate(_ToolUseBlock, block, where)
            ledger.add(use.id, use.name)
            arguments = arguments_text(use.input, f"{where}.input")
            turn.tool_calls.append(ToolCall(id=use.id, name=use.name, arguments=arguments))
        else:
            raise RecipeError(
                f"{where}.type: block {kind!r} is not supported in an assistant message",
                param=f"{where}.type",
            )
    return turn
