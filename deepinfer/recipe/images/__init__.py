"""Image inputs for DeepSeek-V4.1: decoding, the codec's preprocessing, token counts, fetching."""

from __future__ import annotations

from deepinfer.recipe.images.errors import ImageInputError
from deepinfer.recipe.images.geometry import ImageLayout, count_tokens, fit_image
from deepinfer.recipe.images.preprocess import DETAILS, ImagePixels, preprocess

__all__ = [
    "DETAILS",
    "ImageInputError",
    "ImageLayout",
    "ImagePixels",
    "count_tokens",
    "fit_image",
    "preprocess",
]
