"""Request-side pieces shared by the three API parsers."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from deepinfer.recipe.api._validation import ApiModel, require
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.images.decode import bytes_from_data_url
from deepinfer.recipe.images.fetch import check_image_url
from deepinfer.recipe.images.preprocess import DETAILS
from deepinfer.recipe.ir import ImagePart, Thinking

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


class EngineExtensions(ApiModel):
    """Sampling and routing fields every API accepts on top of its own (vLLM-style extensions)."""

    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    seed: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    traffic_class: str | None = Field(default=None, min_length=1)

    def extension_params(self) -> dict[str, Any]:
        """GenerationParams keyword arguments; top_k of 0 or -1 means "no top-k" as in vLLM."""
        return {
            "top_k": self.top_k if self.top_k is not None and self.top_k > 0 else None,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }


def check_min_tokens(min_tokens: int | None, max_tokens: int | None) -> None:
    if min_tokens is not None and max_tokens is not None:
        require(min_tokens <= max_tokens, "must not exceed the maximum number of tokens", "min_tokens")


def arguments_text(value: str | dict[str, Any], param: str) -> str:
    """Tool-call arguments as raw JSON text: a string is kept byte for byte, an object encoded once."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{param}: arguments are not JSON-serializable", param=param) from error


def image_part(url: str, detail: str | None, path: str, url_param: str) -> ImagePart:
    """An image part given by URL, checked now so that a bad one is a 400 naming the field:
    a `data:` URL must hold a supported image type in valid base64 within the size limit, any
    other URL must be http(s) and not too long; `detail` must be one the model knows."""
    if detail is not None and detail not in DETAILS:
        raise RecipeError(f"{path}.detail: must be one of {', '.join(DETAILS)}", param=f"{path}.detail")
    if url.startswith("data:"):
        bytes_from_data_url(url, url_param)
        media_type = url[5:].split(",", 1)[0].split(";", 1)[0] or None
        return ImagePart(url=url, media_type=media_type, detail=detail, path=path)
    check_image_url(url, url_param)
    return ImagePart(url=url, detail=detail, path=path)


def thinking_from_effort(effort: ReasoningEffort | None) -> Thinking:
    """An API's effort field: `none` turns thinking off, any other level turns it on at that level."""
    if effort is None:
        return Thinking()
    return Thinking(enabled=effort != "none", effort=effort)


class ToolCallLedger:
    """Ids of the tool calls seen so far, so that a tool result can be checked and named."""

    __slots__ = ("_names",)

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def add(self, call_id: str, name: str) -> None:
        self._names[call_id] = name

    def name_of(self, call_id: str, param: str) -> str:
        if call_id not in self._names:
            raise RecipeError(f"{param}: no earlier tool call has id {call_id!r}", param=param)
        return self._names[call_id]
