"""DeepSeek V4 / V4.1 model output, parsed by ours and by DeepSeek's codec, for all three APIs.

Generated completions (reasoning, answer text, DSML calls in every spelling, calls without
their block wrapper, cut or malformed calls) are parsed into a Chat Completion, a Response and a
Message by both; the final objects agree field for field, except where ours is stricter on
purpose (docs/recipe.md): a call whose arguments are not a JSON object, or that the token limit
cut, is not reported as a call (the codec reports it with broken arguments), and its DSML never
reaches the answer text. The streamed events of ours, for any chunking, add up to the same.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from deepinfer.recipe import Recipe
from deepinfer.recipe.api import build_chat_completion, build_message, build_response
from tests.recipe.deepseek_reference import MODELS, deepseek_recipe
from tests.recipe.test_deepseek_v4_reference import OURS

D = "｜DSML｜"
TOOLS_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
}
BODIES = {
    "chat": {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS_SCHEMA}}],
    },
    "responses": {
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOLS_SCHEMA}],
    },
    "messages": {
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 512,
        "tools": [{"name": "get_weather", "input_schema": TOOLS_SCHEMA}],
    },
}
CODEC = {
    "chat": (deepseek_recipe.ChatCompletionRequest, deepseek_recipe.ChatCompletionResponse),
    "responses": (deepseek_recipe.ResponsesRequest, deepseek_recipe.ResponsesResponse),
    "messages": (deepseek_recipe.MessagesRequest, deepseek_recipe.MessagesResponse),
}
SPELLINGS = {
    "deepseek_v41": (f"{D} calls", f"{D} invoke", f"{D} parameter"),
    "deepseek_v4": (f"{D}tool_calls", f"{D}invoke", f"{D}parameter"),
    "v32": (f"{D}function_calls", f"{D}invoke", f"{D}parameter"),
}


def completion(seed: int, family: str, thinking: bool) -> tuple[str, str]:
    """(model text, finish) for one generated completion."""
    rng = random.Random(seed)
    parts = []
    if thinking:
        parts.append(rng.choice(["", "\n", "\n\n"]) + rng.choice(["Plan it.", "a\nb", " spaced "]))
        parts.append(rng.choice(["", "\n", "\n\n"]) + "</think>" + rng.choice(["", "\n\n"]))
    parts.append(rng.choice(["", "Sure.", "Hi there 🎉", "line\nbreak ", "x < y & z"]))
    finish = "Stop"
    if rng.random() < 0.7:
        own = SPELLINGS[family]
        calls, invoke, param = own if rng.random() < 0.6 else SPELLINGS[rng.choice(list(SPELLINGS))]
        values = {
            "city": ("true", rng.choice(["Paris", "São Paulo\n2", 'q "x"'])),
            "days": ("false", rng.choice(["3", "0"])),
            "opts": ("false", rng.choice(['{"u": ["°C", null]}', "{bad"])),
        }
        invokes = []
        for _ in range(rng.randint(1, 2)):
            keys = rng.sample(list(values), rng.randint(0, 3))
            params = "".join(
                f'<{param} name="{k}" string="{values[k][0]}">{values[k][1]}</{param}>\n' for k in keys
            )
            invokes.append(f'<{invoke} name="get_weather">\n{params}</{invoke}>')
        body = "\n".join(invokes)
        if rng.random() < 0.15:
            block = body  # the model left out the block wrapper
        else:
            block = f"<{calls}>\n{body}\n</{calls}>"
        block = rng.choice(["\n\n", "\n", " ", ""]) + block
        if rng.random() < 0.15:
            block = block[: rng.randint(len(block) // 3, len(block) - 1)]
            finish = "Length"
        parts.append(block)
    elif rng.random() < 0.2:
        finish = "Length"
    return "".join(parts), finish


def codec_final(api: str, family: str, text: str, finish: str, pieces: list[str]) -> dict[str, Any]:
    request_type, response_type = CODEC[api]
    request = request_type({**BODIES[api], "model": MODELS[family]})
    namespaces = (
        request.namespace_tool_map(deepseek_recipe.ConversionOptions()) if api == "responses" else None
    )
    converted = request.convert(deepseek_recipe.ConversionOptions())
    generator = request_type.chunk_generator(converted, "id", MODELS[family])
    if namespaces:
        generator = generator.with_namespace_tool_map(namespaces)
    processor = deepseek_recipe.StreamProcessor(generator, converted.parsing_options)
    chunks = processor.push(deepseek_recipe.InferenceChunk.ready(prompt_usage=deepseek_recipe.PromptUsage()))
    for piece in pieces:
        chunks += processor.push(deepseek_recipe.InferenceChunk.text(piece, 1))
    chunks += processor.push(
        deepseek_recipe.InferenceChunk.finish(getattr(deepseek_recipe.InferenceFinishReason, finish))
    )
    chunks += processor.finish()
    final = response_type("id", MODELS[family], 0, 0, 0)
    for chunk in chunks:
        final.accumulate(chunk)
    return json.loads(final.to_json())


def our_final(api: str, family: str, pieces: list[str], finish: str) -> dict[str, Any]:
    prompt = Recipe(family).render(OURS[api](BODIES[api]))
    parser = prompt.new_parser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    events += parser.finish("length" if finish == "Length" else "stop")
    if api == "chat":
        return build_chat_completion([events], completion_id="id", model="m", created=0)
    if api == "responses":
        return build_response(events, response_id="resp_id", model="m", created_at=0)
    return build_message(events, message_id="msg_id", model="m")


def summary(api: str, final: dict[str, Any]) -> dict[str, Any]:
    """What the model said, in the API's own terms: reasoning, text, calls, how it ended."""
    if api == "chat":
        choice = final["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return {
            "reasoning": message.get("reasoning_content") or "",
            "text": message.get("content") or "",
            "calls": calls,
            "end": choice["finish_reason"],
        }
    if api == "responses":
        out: dict[str, Any] = {"reasoning": "", "text": "", "calls": [], "end": final["status"]}
        for item in final["output"]:
            if item["type"] == "reasoning":
                out["reasoning"] += "".join(p["text"] for p in item.get("content") or [])
            elif item["type"] == "message":
                out["text"] += "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                out["calls"].append((item["name"], item["arguments"]))
        return out
    out = {"reasoning": "", "text": "", "calls": [], "end": final["stop_reason"]}
    for block in final["content"]:
        if block["type"] == "thinking":
            out["reasoning"] += block["thinking"]
        elif block["type"] == "text":
            out["text"] += block["text"]
        elif block["type"] == "tool_use":
            out["calls"].append((block["name"], json.dumps(block["input"], ensure_ascii=False)))
    return out


def _valid(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


def stricter(codec: dict[str, Any], api: str, text: str, raw_arguments: list[str]) -> dict[str, Any]:
    """The codec's summary with the documented differences applied: calls with broken arguments
    (`raw_arguments`: the codec's Chat Completions arguments, since its Messages output turns
    them into `{}`), and a call the token limit cut (its invoke never closed), are not calls."""
    out = dict(codec)
    closed = sum(text.count(f"</{D}{gap}invoke>") for gap in ("", " "))
    calls = [c for c, raw in zip(codec["calls"][:closed], raw_arguments) if _valid(raw)]
    if len(calls) != len(codec["calls"]):
        out["calls"] = calls
        if not calls and codec["end"] in ("tool_calls", "completed", "tool_use"):
            out["end"] = {"chat": "stop", "responses": "completed", "messages": "end_turn"}[api]
    return out


def raw_arguments(family: str, text: str, finish: str) -> list[str]:
    return [
        arguments
        for _, arguments in summary("chat", codec_final("chat", family, text, finish, [text]))["calls"]
    ]


def chunked(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


CASES = 120


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("api", list(BODIES))
def test_generated_completions_parse_as_the_codec_parses(api: str, family: str) -> None:
    failures = []
    identical = 0
    for seed in range(CASES):
        text, finish = completion(seed, family, thinking=True)
        codec = summary(api, codec_final(api, family, text, finish, [text]))
        ours = summary(api, our_final(api, family, [text], finish))
        if ours == codec:
            identical += 1
        elif ours != stricter(codec, api, text, raw_arguments(family, text, finish)):
            failures.append((seed, text, finish, ours, codec))
        assert D not in ours["text"], (seed, text)
        streamed = summary(api, our_final(api, family, chunked(text, random.Random(seed)), finish))
        assert streamed == ours, (seed, text)
    assert not failures, failures[:3]
    assert identical >= CASES * 0.6


@pytest.mark.parametrize("family", list(MODELS))
def test_thinking_off_and_forced_calls_parse_as_the_codec_parses(family: str) -> None:
    """Thinking off, and a forced call whose block the prompt opened."""
    body = {**BODIES["chat"], "thinking": {"type": "disabled"}}
    forced = {**body, "tool_choice": "required"}
    _, invoke, param = SPELLINGS[family]
    cases = [
        (body, "Plain answer.\n"),
        (
            body,
            f'Calling.\n\n<{SPELLINGS[family][0]}>\n<{invoke} name="get_weather">\n</{invoke}>\n</{SPELLINGS[family][0]}>',
        ),
        (
            forced,
            f'<{invoke} name="get_weather">\n<{param} name="days" string="false">2</{param}>\n</{invoke}>\n</{SPELLINGS[family][0]}>',
        ),
    ]
    for request, text in cases:
        request_type, response_type = CODEC["chat"]
        converted = request_type({**request, "model": MODELS[family]}).convert(
            deepseek_recipe.ConversionOptions()
        )
        generator = request_type.chunk_generator(converted, "id", MODELS[family])
        processor = deepseek_recipe.StreamProcessor(generator, converted.parsing_options)
        chunks = processor.push(deepseek_recipe.InferenceChunk.text(text, 1))
        chunks += processor.push(
            deepseek_recipe.InferenceChunk.finish(deepseek_recipe.InferenceFinishReason.Stop)
        )
        chunks += processor.finish()
        final = response_type("id", MODELS[family], 0, 0, 0)
        for chunk in chunks:
            final.accumulate(chunk)
        prompt = Recipe(family).render(OURS["chat"](request))
        ours = build_chat_completion([_events(prompt, text)], completion_id="id", model="m", created=0)
        assert summary("chat", ours) == summary("chat", json.loads(final.to_json())), text


def _events(prompt: Any, text: str) -> list[Any]:
    parser = prompt.new_parser()
    return parser.feed(text) + parser.finish("stop")
