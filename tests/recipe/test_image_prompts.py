"""Images in V4.1 prompts against DeepSeek's codec: the prompt text, which image each
placeholder stands for (tool results are written in call order, their images too), the detail
each is preprocessed at, and the prompt length with images counted at their token counts."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from deepinfer.recipe import Recipe
from deepinfer.recipe.api import (
    chat_completion_to_conversation,
    messages_to_conversation,
    responses_to_conversation,
)
from deepinfer.recipe.images import preprocess
from deepinfer.recipe.images.source import image_token_adjustment, prepare_image
from tests.recipe.deepseek_reference import deepseek_recipe, reference


def _data_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, "PNG"
    )
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


WIDE, TALL, SMALL = _data_url(900, 300), _data_url(200, 700), _data_url(30, 20)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


CHAT = {
    "tools": [TOOL],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": WIDE, "detail": "low"}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [_call("a"), _call("b")]},
        # answered out of order: b, then a
        {
            "role": "tool",
            "tool_call_id": "b",
            "content": [{"type": "text", "text": "B"}, {"type": "image_url", "image_url": {"url": TALL}}],
        },
        {
            "role": "tool",
            "tool_call_id": "a",
            "content": [{"type": "image_url", "image_url": {"url": SMALL, "detail": "high"}}],
        },
    ],
}

MESSAGES = {
    "max_tokens": 100,
    "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": TALL.split(",", 1)[1]},
                },
                {"type": "text", "text": "what is it?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": WIDE.split(",", 1)[1],
                            },
                        }
                    ],
                }
            ],
        },
    ],
}


@pytest.mark.parametrize(
    ("api", "body", "parse"),
    [("chat", CHAT, chat_completion_to_conversation), ("messages", MESSAGES, messages_to_conversation)],
)
def test_prompt_and_image_order_match_the_codec(api: str, body: dict[str, Any], parse: Any) -> None:
    ref = reference(api, body, "deepseek_v41")
    assert ref.error is None, ref.error
    rendered = deepseek_recipe.DeepseekV41Encoding().render_conversation(ref.converted.conversation)
    prompt = Recipe("deepseek_v41").render(parse({**body, "model": "m"}))
    assert prompt.text == rendered.prompt
    assert prompt.text.count("<｜image｜>") == len(prompt.images) == len(rendered.image_sources)
    for ours, theirs in zip(prompt.images, rendered.image_sources, strict=True):
        assert ours.url == theirs.data_url
        assert (ours.detail or "high") == theirs.detail


def test_prompt_length_counts_each_image_at_its_token_count() -> None:
    ref = reference("chat", CHAT, "deepseek_v41")
    rendered = deepseek_recipe.DeepseekV41Encoding().render_conversation(ref.converted.conversation)
    resolver = deepseek_recipe.ImageResolver(
        deepseek_recipe.ReqwestImageFetcher(), deepseek_recipe.OpenCvImagePreprocessor()
    )
    theirs = resolver.resolve(rendered.image_sources, deepseek_recipe.ImageQuota())
    prompt = Recipe("deepseek_v41").render(chat_completion_to_conversation({**CHAT, "model": "m"}))
    ours = [prepare_image(part) for part in prompt.images]
    assert [x.webp for x in ours] == [x.data for x in theirs.images]
    assert image_token_adjustment(ours) == theirs.image_token_adjustment()
    assert ours[0].num_tokens == preprocess(base64.b64decode(WIDE.split(",", 1)[1]), "low").num_tokens


def _parts(*items: str) -> list[dict[str, str]]:
    return [
        {"type": "input_image", "image_url": SMALL} if x == "IMG" else {"type": "input_text", "text": x}
        for x in items
    ]


SYSTEM_CASES = [
    (
        "responses",
        {
            "input": [
                {"role": "system", "content": _parts("a", "IMG", "b")},
                {"role": "user", "content": "ho"},
            ]
        },
    ),
    (
        "responses",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": _parts("a", "b")},
                {"role": "user", "content": "ho"},
            ]
        },
    ),
    (
        "responses",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"role": "developer", "content": _parts("IMG", "b")},
                {"role": "user", "content": "ho"},
            ]
        },
    ),
    (
        "chat",
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "ho"},
            ]
        },
    ),
    (
        "messages",
        {
            "max_tokens": 10,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [{"role": "user", "content": "ho"}],
        },
    ),
]
PARSERS = {
    "chat": chat_completion_to_conversation,
    "responses": responses_to_conversation,
    "messages": messages_to_conversation,
}


@pytest.mark.parametrize("family", ["deepseek_v41", "deepseek_v4"])
@pytest.mark.parametrize(("api", "body"), SYSTEM_CASES)
def test_system_turns_with_several_parts_and_images_match_the_codec(
    family: str, api: str, body: dict[str, Any]
) -> None:
    """A system (or V4.1 developer) message's parts are joined by a blank line, an image as its
    placeholder (V4: `[Unsupported Image]`), like a user message's."""
    parse = PARSERS[api]
    ref = reference(api, body, family)
    assert ref.error is None, ref.error
    prompt = Recipe(family).render(parse({**body, "model": "m"}))
    assert prompt.text == ref.prompt
    expected_images = ref.prompt.count("<｜image｜>") if family == "deepseek_v41" else 0
    assert len(prompt.images) == expected_images
