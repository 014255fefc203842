"""OpenAI Chat Completions requests: the request body -> Conversation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from deepinfer.recipe.api._request import (
    EMPTY_OBJECT_SCHEMA,
    EngineExtensions,
    ReasoningEffort,
    ToolCallLedger,
    arguments_text,
    check_min_tokens,
    image_part,
    thinking_from_effort,
)
from deepinfer.recipe.api._validation import ApiModel, require, validate
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import (
    ContentPart,
    Conversation,
    GenerationParams,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)

# ---------------------------------------------------------------- request models


class _FunctionDef(ApiModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _ToolDef(ApiModel):
    type: Literal["function"]
    function: _FunctionDef


class _CalledFunction(ApiModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""


class _ToolCallIn(ApiModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: _CalledFunction


class _MessageIn(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    prefix: bool = False  # DeepSeek's assistant-prefix continuation (the last message only)


class _TextPartIn(ApiModel):
    text: str


class _RefusalPartIn(ApiModel):
    refusal: str


class _ImageUrl(ApiModel):
    url: str = Field(min_length=1)
    detail: str | None = None


class _ImagePartIn(ApiModel):
    image_url: _ImageUrl | str


class _NamedFunction(ApiModel):
    name: str = Field(min_length=1)


class _NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: _NamedFunction


class _JsonSchemaSpec(ApiModel):
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _ResponseFormatIn(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaSpec | None = None


class _StreamOptions(ApiModel):
    include_usage: bool | None = None


class _ThinkingToggle(ApiModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ChatCompletionRequest(EngineExtensions):
    """The request body of POST /v1/chat/completions (fields the engine uses; others ignored)."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: _ResponseFormatIn | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    user: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: _ThinkingToggle | None = None


# ---------------------------------------------------------------- request -> Conversation


def parse_chat_completion_request(body: Any) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, body)


def chat_completion_to_conversation(body: Any) -> Conversation:
    """Validate a raw Chat Completions body and turn it into the Conversation IR.

    Raises RecipeError with `param` naming the offending field.
    """
    request = parse_chat_completion_request(body)
    tools = [_tool(t) for t in request.tools or []]
    ledger = ToolCallLedger()
    messages = [_message(i, raw, ledger) for i, raw in enumerate(request.messages)]
    stream = bool(request.stream)
    return Conversation(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        thinking=_thinking(request),
        params=_params(request),
        response_format=_response_format(request.response_format),
        model=request.model,
        stream=stream,
        include_usage=stream and bool(request.stream_options and request.stream_options.include_usage),
        cache_salt=request.cache_salt,
        traffic_class=request.traffic_class,
        user=request.user,
    )


def _tool(spec: _ToolDef) -> Tool:
    function = spec.function
    parameters = function.parameters if function.parameters is not None else dict(EMPTY_OBJECT_SCHEMA)
    return Tool(
        name=function.name,
        description=function.description,
        parameters=parameters,
        strict=bool(function.strict),
    )


def _content(content: str | list[dict[str, Any]] | None, role: str, path: str) -> list[ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(content)]
    parts: list[ContentPart] = []
    for j, raw in enumerate(content):
        where = f"{path}[{j}]"
        kind = raw.get("type")
        if kind == "text":
            parts.append(TextPart(validate(_TextPartIn, raw, where).text))
        elif kind == "refusal" and role == "assistant":
            parts.append(TextPart(validate(_RefusalPartIn, raw, where).refusal))
        elif kind == "image_url" and role in ("user", "tool"):
            image = validate(_ImagePartIn, raw, where).image_url
            if isinstance(image, str):
                parts.append(image_part(image, None, where, f"{where}.image_url"))
            else:
                parts.append(image_part(image.url, image.detail, where, f"{where}.image_url.url"))
        else:
            raise RecipeError(
                f"{where}.type: content part {kind!r} is not supported in a {role} message",
                param=f"{where}.type",
            )
    return parts


def _message(index: int, raw: Any, ledger: ToolCallLedger) -> Message:
    path = f"messages[{index}]"
    msg = validate(_MessageIn, raw, path)
    content = _content(msg.content, msg.role, f"{path}.content")
    if msg.role != "assistant":
        require(msg.content is not None, f"content is required in a {msg.role} message", f"{path}.content")
    if msg.role == "tool":
        require(bool(msg.tool_call_id), "is required in a tool message", f"{path}.tool_call_id")
        call_id = msg.tool_call_id or ""
        name = ledger.name_of(call_id, f"{path}.tool_call_id")
        return Message(role="tool", content=content, tool_call_id=call_id, name=name)
    require(
        not msg.prefix or msg.role == "assistant",
        "only an assistant message can be a prefix",
        f"{path}.prefix",
    )
    if msg.role != "assistant":
        return Message(role=msg.role, content=content, name=msg.name)
    calls = []
    for j, call in enumerate(msg.tool_calls or []):
        arguments = arguments_text(call.function.arguments, f"{path}.tool_calls[{j}].function.arguments")
        ledger.add(call.id, call.function.name)
        calls.append(ToolCall(id=call.id, name=call.function.name, arguments=arguments))
    reasoning_text = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    reasoning = [Reasoning(text=reasoning_text)] if reasoning_text else []
    return Message(
        role="assistant",
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        name=msg.name,
        prefix=msg.prefix,
    )


def _tool_choice(value: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        require(
            value in ("none", "auto", "required"),
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
        require(value != "required" or bool(tools), "'required' needs at least one tool", "tool_choice")
        return ToolChoice(mode=value)  # type: ignore[arg-type]
    name = validate(_NamedToolChoice, value, "tool_choice").function.name
    require(
        any(t.name == name for t in tools),
        f"names {name!r}, which is not in tools",
        "tool_choice.function.name",
    )
    return ToolChoice(mode="named", name=name)


def _response_format(spec: _ResponseFormatIn | None) -> ResponseFormat | None:
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ResponseFormat(type="json_object")
    require(
        spec.json_schema is not None, "is required when type is 'json_schema'", "response_format.json_schema"
    )
    schema = spec.json_schema
    assert schema is not None
    if schema.schema_ is None:
        return ResponseFormat(type="json_object", name=schema.name)
    return ResponseFormat(
        type="json_schema", json_schema=schema.schema_, name=schema.name, strict=bool(schema.strict)
    )


def _thinking(request: ChatCompletionRequest) -> Thinking:
    """chat_template_kwargs wins over the `thinking` toggle, which wins over reasoning_effort."""
    budget = request.thinking.budget_tokens if request.thinking else None
    for key in ("enable_thinking", "thinking"):
        if request.chat_template_kwargs and key in request.chat_template_kwargs:
            value = request.chat_template_kwargs[key]
            require(isinstance(value, bool), "must be a boolean", f"chat_template_kwargs.{key}")
            effort = request.reasoning_effort if value and request.reasoning_effort != "none" else None
            return Thinking(enabled=value, budget_tokens=budget if value else None, effort=effort)
    effort = request.reasoning_effort
    if request.thinking is not None:
        if request.thinking.type == "disabled":
            return Thinking(enabled=False)
        return Thinking(enabled=True, budget_tokens=budget, effort=effort if effort != "none" else None)
    return thinking_from_effort(effort)


def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    sequences = [stop] if isinstance(stop, str) else stop
    for j, seq in enumerate(sequences):
        require(
            seq != "", "stop sequences must not be empty", "stop" if isinstance(stop, str) else f"stop[{j}]"
        )
    return list(sequences)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        require(key.isdigit(), "keys must be token ids", f"logit_bias.{key}")
        require(-100 <= value <= 100, "must be between -100 and 100", f"logit_bias.{key}")
        result[int(key)] = value
    return result


def _params(request: ChatCompletionRequest) -> GenerationParams:
    logprobs = bool(request.logprobs)
    if request.top_logprobs:
        require(logprobs, "requires logprobs to be true", "top_logprobs")
    max_tokens = request.max_completion_tokens or request.max_tokens
    check_min_tokens(request.min_tokens, max_tokens)
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        n=request.n or 1,
        stop=_stop(request.stop),
        logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else None,
        logit_bias=_logit_bias(request.logit_bias),
        **request.extension_params(),
    )
