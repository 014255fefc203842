"""The error for an image the server cannot take: a RecipeError (a 400) naming the part."""

from __future__ import annotations

from deepinfer.recipe.errors import RecipeError


class ImageInputError(RecipeError):
    """`param` is the request path of the image part, e.g. `messages[0].content[1]`."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}" if where else reason, param=where or None)
