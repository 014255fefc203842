"""The API side of images (server/images.py) without a server: placeholders expanded in order
to each image's tokens, a count that does not pair up refused, a bad image answered as data."""

from __future__ import annotations

import pytest

from deepinfer.image_input import ImageInput, image_content_hash
from deepinfer.recipe.ir import ImagePart
from deepinfer.server.errors import ApiError
from deepinfer.server.images import ImageRefused, expand_placeholders, prepare_for_engine

P = 9  # the placeholder id


def _image(num_tokens: int, seed: int) -> ImageInput:
    pixels = bytes([seed]) * (14 * 14 * 3)
    return ImageInput(0, num_tokens, 1, 1, pixels, image_content_hash(pixels, 1, 1))


def test_placeholders_become_each_images_tokens_in_order() -> None:
    ids, placed = expand_placeholders([1, P, 2, 3, P, 4], [_image(3, 1), _image(2, 2)], P, "messages")
    assert ids == [1, P, P, P, 2, 3, P, P, 4]
    assert [(i.offset, i.end) for i in placed] == [(1, 4), (6, 8)]
    assert placed[0].content_hash != placed[1].content_hash


def test_a_placeholder_written_in_the_text_is_refused() -> None:
    with pytest.raises(ApiError) as raised:
        expand_placeholders([1, P, 2, P], [_image(3, 1)], P, "messages")
    assert raised.value.status == 400 and raised.value.param == "messages"


def test_a_bad_image_comes_back_as_a_refusal_naming_the_part() -> None:
    part = ImagePart(url="data:image/png;base64,aGVsbG8=", path="messages[0].content[1]")
    refused = prepare_for_engine(part)
    assert isinstance(refused, ImageRefused) and refused.param == "messages[0].content[1]"
