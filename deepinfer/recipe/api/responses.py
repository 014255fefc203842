"""OpenAI Responses requests: the request body -> Conversation, plus the settings echoed back.

The codec itself is stateless. A server with a response store parses with `stored=True` and
passes the items of the earlier turns (`previous_response_id`, resolved by the server) as
`history`; without one, `previous_response_id` and `background` are refused, and reasoning
items, function calls and their outputs must come back inside `input`. `conversation` (the
Conversations API) is always refused. Reasoning can travel encrypted (`include:
["reasoning.encrypted_content"]`, responses_reasoning.py); tools are declared as
responses_tools.py describes (functions, namespaces, apply_patch, hosted tools).
`prompt_cache_key` is kept on the Conversation as a routing hint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
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
from deepinfer.recipe.api.responses_reasoning import ENCRYPTED_REASONING_INCLUDE, ReasoningSealer
from deepinfer.recipe.api.responses_tools import CUSTOM_INPUT, HostedTools, declared_tools, flat_name
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import (
    ContentPart,
    Conversation,
    GenerationParams,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
)

# The `include` entry that asks for the logprobs of output text.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# ---------------------------------------------------------------- request models


class _NamedToolChoice(ApiModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class _TextFormat(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _TextConfig(ApiModel):
    format: _TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _ReasoningConfig(ApiModel):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class _InputMessage(ApiModel):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class _SummaryText(ApiModel):
    type: Literal["summary_text"]
    text: str


class _ReasoningText(ApiModel):
    type: Literal["reasoning_text"]
    text: str


class _ReasoningItem(ApiModel):
    summary: list[_SummaryText] = Field(default_factory=list)
    content: list[_ReasoningText] | None = None
    encrypted_content: str | None = None


class _FunctionCallItem(ApiModel):
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    arguments: str | dict[str, Any]


class _CustomToolCallItem(ApiModel):
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str


class _FunctionCallOutputItem(ApiModel):
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class _TextPartIn(ApiModel):
    text: str


class _RefusalPartIn(ApiModel):
    refusal: str


class _ImagePartIn(ApiModel):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class ResponsesRequest(EngineExtensions):
    """The request body of POST /v1/responses (fields the engine uses; others ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    reasoning: _ReasoningConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None


@dataclass(frozen=True, slots=True)
class ResponsesOptions:
    """Server settings the conversion needs: what to do with hosted tools, and the key that opens
    encrypted reasoning (None: encrypted reasoning cannot be read)."""

    hosted_tools: HostedTools = "drop"
    reasoning: ReasoningSealer | None = None


# ---------------------------------------------------------------- request -> Conversation


def parse_responses_request(body: Any, *, stored: bool = False) -> ResponsesRequest:
    """Validate a body. `stored`: the server keeps responses, so `previous_response_id` and
    `background` are accepted (and `background` needs `store`)."""
    request = validate(ResponsesRequest, body)
    _refuse_state(request, stored)
    return request


def responses_to_conversation(body: Any, options: ResponsesOptions | None = None) -> Conversation:
    """Validate a raw Responses body (a stateless one) and turn it into the Conversation IR."""
    return request_to_conversation(parse_responses_request(body), options)


def request_to_conversation(
    request: ResponsesRequest,
    options: ResponsesOptions | None = None,
    history: Sequence[dict[str, Any]] = (),
) -> Conversation:
    """The Conversation of a request. `history`: the items of the earlier turns of a
    `previous_response_id` conversation (their inputs and outputs, oldest first), read before
    `input`; the earlier turns' instructions are not among them (the API does not carry them
    over), the request's own are the system message."""
    options = options or ResponsesOptions()
    tools = declared_tools(request.tools or [], options.hosted_tools).tools
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message(role="system", content=[TextPart(request.instructions)]))
    items: list[tuple[str, Any]] = [("previous_response_id", item) for item in history]
    if isinstance(request.input, str):
        items.append(("input", {"role": "user", "content": request.input}))
    else:
        items.extend((f"input[{i}]", item) for i, item in enumerate(request.input))
    messages.extend(_input_messages(items, options.reasoning))
    max_tokens = request.max_output_tokens
    check_min_tokens(request.min_tokens, max_tokens)
    logprobs = request.top_logprobs is not None or LOGPROBS_INCLUDE in (request.include or [])
    params = GenerationParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        logprobs=logprobs,
        top_logprobs=request.top_logprobs,
        **request.extension_params(),
    )
    return Conversation(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        thinking=thinking_from_effort(request.reasoning.effort if request.reasoning else None),
        params=params,
        response_format=_response_format(request.text),
        model=request.model,
        stream=bool(request.stream),
        cache_salt=request.cache_salt,
        traffic_class=request.traffic_class,
        user=request.user,
        prompt_cache_key=request.prompt_cache_key,
    )


def wants_encrypted_reasoning(request: ResponsesRequest) -> bool:
    return ENCRYPTED_REASONING_INCLUDE in (request.include or [])


def _refuse_state(request: ResponsesRequest, stored: bool) -> None:
    stateless = "this server keeps no responses: send the whole conversation in `input`"
    if stored:
        require(
            not (request.background and request.store is False),
            "background responses are stored: they need `store: true` (the default)",
            "background",
        )
    else:
        require(
            request.previous_response_id is None, f"is not supported; {stateless}", "previous_response_id"
        )
        require(not request.background, "background responses are not supported", "background")
    require(
        request.conversation is None,
        "the Conversations API is not supported; continue with `previous_response_id`, or send the whole "
        "conversation in `input`",
        "conversation",
    )
    require(request.prompt is None, "stored prompts are not supported", "prompt")


def _tool_choice(value: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        require(
            value in ("none", "auto", "required"),
            "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
            "tool_choice",
        )
        require(value != "required" or bool(tools), "'required' needs at least one tool", "tool_choice")
        return ToolChoice(mode=value)  # type: ignore[arg-type]
    name = validate(_NamedToolChoice, value, "tool_choice").name
    require(any(t.name == name for t in tools), f"names {name!r}, which is not in tools", "tool_choice.name")
    return ToolChoice(mode="named", name=name)


def _response_format(text: _TextConfig | None) -> ResponseFormat | None:
    spec = text.format if text else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ResponseFormat(type="json_object")
    require(bool(spec.name), "is required when type is 'json_schema'", "text.format.name")
    require(spec.schema_ is not None, "is required when type is 'json_schema'", "text.format.schema")
    return ResponseFormat(
        type="json_schema", json_schema=spec.schema_, name=spec.name, strict=bool(spec.strict)
    )


def _parts(content: str | list[dict[str, Any]], role: str, path: str) -> list[ContentPart]:
    if isinstance(content, str):
        return [TextPart(content)]
    parts: list[ContentPart] = []
    for j, raw in enumerate(content):
        where = f"{path}[{j}]"
        kind = raw.get("type")
        if kind == "input_text" or (kind == "output_text" and role == "assistant"):
            parts.append(TextPart(validate(_TextPartIn, raw, where).text))
        elif kind == "refusal" and role == "assistant":
            parts.append(TextPart(validate(_RefusalPartIn, raw, where).refusal))
        elif kind == "input_image" and role != "assistant":
            image = validate(_ImagePartIn, raw, where)
            require(image.image_url is not None, "only image_url images are supported", f"{where}.image_url")
            parts.append(image_part(image.image_url or "", image.detail, where, f"{where}.image_url"))
        else:
            raise RecipeError(
                f"{where}.type: content part {kind!r} is not supported in a {role} message",
                param=f"{where}.type",
            )
    return parts


def _input_messages(items: list[tuple[str, Any]], sealer: ReasoningSealer | None) -> list[Message]:
    """Flat (path, item) pairs -> turns: consecutive reasoning / assistant text / function calls
    form one assistant turn (reasoning first, then text, then calls), as the model produced them."""
    messages: list[Message] = []
    ledger = ToolCallLedger()
    for path, raw in items:
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: expected a JSON object", param=path)
        kind = raw.get("type", "message")
        if kind == "message":
            item = validate(_InputMessage, raw, path)
            content = _parts(item.content, item.role, f"{path}.content")
            if item.role == "assistant":
                _assistant_turn(messages, "text").content.extend(content)
            else:
                messages.append(Message(role=item.role, content=content))
        elif kind == "reasoning":
            reasoning = validate(_ReasoningItem, raw, path)
            # Only the reasoning itself is replayed: a summary is a digest for people, which
            # DeepSeek's codec leaves out of the prompt too (an item with only one opens no turn).
            text = "".join(t.text for t in reasoning.content or [])
            if not text and reasoning.encrypted_content:
                if sealer is None:
                    raise RecipeError(
                        f"{path}.encrypted_content: this server has no key for encrypted reasoning",
                        param=f"{path}.encrypted_content",
                    )
                text = sealer.open(reasoning.encrypted_content, f"{path}.encrypted_content")
            if text:  # an empty reasoning item opens no turn
                _assistant_turn(messages, "reasoning").reasoning.append(
                    Reasoning(text=text, redacted_data=reasoning.encrypted_content)
                )
        elif kind == "function_call":
            call = validate(_FunctionCallItem, raw, path)
            arguments = arguments_text(call.arguments, f"{path}.arguments")
            name = flat_name(call.namespace, call.name)
            ledger.add(call.call_id, name)
            _assistant_turn(messages, "call").tool_calls.append(
                ToolCall(id=call.call_id, name=name, arguments=arguments)
            )
        elif kind == "custom_tool_call":
            custom = validate(_CustomToolCallItem, raw, path)
            ledger.add(custom.call_id, custom.name)
            arguments = json.dumps({CUSTOM_INPUT: custom.input}, ensure_ascii=False)
            _assistant_turn(messages, "call").tool_calls.append(
                ToolCall(id=custom.call_id, name=custom.name, arguments=arguments)
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            result = validate(_FunctionCallOutputItem, raw, path)
            name = ledger.name_of(result.call_id, f"{path}.call_id")
            content = _parts(result.output, "tool", f"{path}.output")
            messages.append(Message(role="tool", content=content, tool_call_id=result.call_id, name=name))
        else:
            raise RecipeError(f"{path}.type: input item {kind!r} is not supported", param=f"{path}.type")
    return messages


def _assistant_turn(messages: list[Message], kind: Literal["reasoning", "text", "call"]) -> Message:
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        fits = {
            "reasoning": not last.content and not last.tool_calls,
            "text": not last.tool_calls,
            "call": True,
        }[kind]
        if fits:
            return last
    turn = Message(role="assistant")
    messages.append(turn)
    return turn


def response_echo(request: ResponsesRequest, *, stored: bool = False) -> dict[str, Any]:
    """The request settings a `response` object repeats back to the client (tools as declared).
    `stored`: the server keeps this response."""
    tool_choice: Any = request.tool_choice if request.tool_choice is not None else "auto"
    text_format = request.text.format if request.text and request.text.format else None
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": request.reasoning.effort if request.reasoning else None,
            "summary": request.reasoning.summary if request.reasoning else None,
        },
        "store": stored,
        "background": bool(request.background),
        "temperature": request.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": tool_choice,
        "tools": [_echo_tool(raw) for raw in request.tools or []],
        "prompt_cache_key": request.prompt_cache_key,
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p,
        "truncation": request.truncation or "disabled",
        "user": request.user,
    }


def _echo_tool(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("type") != "function":
        return raw
    return {
        "type": "function",
        "name": raw.get("name"),
        "description": raw.get("description"),
        "parameters": raw.get("parameters")
        if raw.get("parameters") is not None
        else dict(EMPTY_OBJECT_SCHEMA),
        "strict": bool(raw.get("strict")),
    }
