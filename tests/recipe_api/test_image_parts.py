"""Image parts of the three APIs: what each becomes in the IR, and the 400s for bad ones.

Every accepted part keeps its source, its `detail` and the request path of the part (so a
later failure, fetching or decoding, names it); every refused part names the field.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from deepinfer.recipe.api import chat_completion_to_conversation, messages_to_conversation
from deepinfer.recipe.api.responses import responses_to_conversation
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.ir import Conversation, ImagePart


def _png() -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png()
DATA_URL = f"data:image/png;base64,{PNG}"
CALL = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}


def _images(conv: Conversation) -> list[tuple[str, ImagePart]]:
    return [(m.role, p) for m in conv.messages for p in m.content if isinstance(p, ImagePart)]


def _chat(content: list[dict[str, Any]], tool_content: list[dict[str, Any]] | None = None) -> Conversation:
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if tool_content is not None:
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": tool_content},
        ]
    return chat_completion_to_conversation({"model": "m", "messages": messages})


def _refused(parse: Any, body: Any) -> str:
    with pytest.raises(RecipeError) as refused:
        parse(body)
    assert refused.value.param and str(refused.value).startswith(refused.value.param)
    return refused.value.param


def test_chat_image_url_parts_in_user_messages_and_tool_results() -> None:
    conv = _chat(
        [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        ],
        tool_content=[{"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}}],
    )
    assert _images(conv) == [
        (
            "user",
            ImagePart(url=DATA_URL, media_type="image/png", detail="low", path="messages[0].content[1]"),
        ),
        ("user", ImagePart(url="https://example.com/a.png", path="messages[0].content[2]")),
        (
            "tool",
            ImagePart(url=DATA_URL, media_type="image/png", detail="high", path="messages[2].content[0]"),
        ),
    ]


@pytest.mark.parametrize(
    ("image_url", "param"),
    [
        ({"url": f"data:image/png;base64,{PNG[:-3]}"}, "messages[0].content[0].image_url.url"),  # truncated
        ({"url": "data:application/pdf;base64,JVBERi0="}, "messages[0].content[0].image_url.url"),
        ({"url": "data:image/png;base64"}, "messages[0].content[0].image_url.url"),
        ({"url": "ftp://example.com/a.png"}, "messages[0].content[0].image_url.url"),
        ({"url": "https://" + "a" * 9000 + ".com/"}, "messages[0].content[0].image_url.url"),
        ({"url": DATA_URL, "detail": "medium"}, "messages[0].content[0].detail"),
        ({"detail": "low"}, "messages[0].content[0].image_url.url"),
    ],
)
def test_chat_bad_image_parts_are_400s_naming_the_field(image_url: dict[str, str], param: str) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}],
    }
    assert _refused(chat_completion_to_conversation, body) == param


def test_chat_images_are_refused_in_system_and_assistant_messages() -> None:
    for role in ("system", "assistant"):
        body = {
            "model": "m",
            "messages": [{"role": role, "content": [{"type": "image_url", "image_url": DATA_URL}]}],
        }
        assert _refused(chat_completion_to_conversation, body) == "messages[0].content[0].type"


def _responses(input_items: list[dict[str, Any]]) -> Conversation:
    return responses_to_conversation({"model": "m", "input": input_items})


def test_responses_input_image_in_messages_and_function_call_outputs() -> None:
    conv = _responses(
        [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": DATA_URL, "detail": "original"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [
                    {"type": "input_text", "text": "here"},
                    {"type": "input_image", "image_url": "http://example.com/x.webp", "detail": "auto"},
                ],
            },
        ]
    )
    assert _images(conv) == [
        (
            "user",
            ImagePart(url=DATA_URL, media_type="image/png", detail="original", path="input[0].content[0]"),
        ),
        ("tool", ImagePart(url="http://example.com/x.webp", detail="auto", path="input[2].output[1]")),
    ]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG[:-2]}"},
            "input[0].content[0].image_url",
        ),
        ({"type": "input_image", "image_url": "data:text/plain,hello"}, "input[0].content[0].image_url"),
        ({"type": "input_image", "file_id": "file_1"}, "input[0].content[0].image_url"),
        ({"type": "input_image", "image_url": DATA_URL, "detail": "max"}, "input[0].content[0].detail"),
    ],
)
def test_responses_bad_image_parts_are_400s_naming_the_field(part: dict[str, Any], param: str) -> None:
    body = {"model": "m", "input": [{"role": "user", "content": [part]}]}
    assert _refused(responses_to_conversation, body) == param


def _messages(content: list[dict[str, Any]], result: list[dict[str, Any]] | None = None) -> Conversation:
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if result is not None:
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "tu_1", "name": "look", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": result}]},
        ]
    return messages_to_conversation({"model": "m", "max_tokens": 10, "messages": messages})


def test_messages_image_blocks_base64_and_url_in_user_turns_and_tool_results() -> None:
    conv = _messages(
        [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}},
        ],
        result=[{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}],
    )
    assert _images(conv) == [
        ("user", ImagePart(url=DATA_URL, media_type="image/png", path="messages[0].content[0]")),
        ("user", ImagePart(url="https://example.com/b.jpg", path="messages[0].content[1]")),
        ("tool", ImagePart(url=DATA_URL, media_type="image/png", path="messages[2].content[0].content[0]")),
    ]


@pytest.mark.parametrize(
    ("source", "param"),
    [
        (
            {"type": "base64", "media_type": "image/png", "data": PNG[:-3]},
            "messages[0].content[0].source.data",
        ),
        (
            {"type": "base64", "media_type": "image/bmp", "data": PNG},
            "messages[0].content[0].source.media_type",
        ),
        ({"type": "base64", "data": PNG}, "messages[0].content[0].source.media_type"),
        ({"type": "url", "url": "file:///etc/passwd"}, "messages[0].content[0].source.url"),
        ({"type": "url", "url": DATA_URL}, "messages[0].content[0].source.url"),
    ],
)
def test_messages_bad_image_blocks_are_400s_naming_the_field(source: dict[str, str], param: str) -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    assert _refused(messages_to_conversation, body) == param
