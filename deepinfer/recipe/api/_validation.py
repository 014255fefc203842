"""Pydantic base model for API bodies and the conversion of validation errors into RecipeError.

Every request model ignores unknown fields (the real APIs do) and validates strictly (JSON types:
"0.5" is not a number). Errors name the offending field as a path such as `messages[2].content`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer.recipe.errors import RecipeError


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


ModelT = TypeVar("ModelT", bound=ApiModel)

# pydantic names union members and validator wrappers inside `loc`; they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_type_tag(segment: str) -> bool:
    # Union members that are models appear under their class name (ours are `_Private`).
    model_name = segment.startswith("_") and segment[1:2].isupper()
    return segment in _TYPE_TAGS or "[" in segment or segment.startswith("function-") or model_name


def join_path(prefix: str, segment: str | int) -> str:
    if isinstance(segment, int):
        return f"{prefix}[{segment}]"
    return f"{prefix}.{segment}" if prefix else segment


def format_loc(loc: tuple[str | int, ...], prefix: str = "") -> str:
    path = prefix
    for segment in loc:
        if isinstance(segment, str) and _is_type_tag(segment):
            continue
        path = join_path(path, segment)
    return path


def recipe_error_from(error: ValidationError, prefix: str = "") -> RecipeError:
    """The most specific error wins (deepest path, a wrong value before a missing field);
    union alternatives failing at the same path are joined."""
    details = error.errors(include_url=False)
    paths = [format_loc(tuple(d["loc"]), prefix) for d in details]
    ranked = sorted(
        zip(details, paths),
        key=lambda dp: (dp[1].count(".") + dp[1].count("["), dp[0]["type"] != "missing"),
        reverse=True,
    )
    deepest = ranked[0][1]
    messages: list[str] = []
    for detail, path in zip(details, paths):
        if path == deepest and detail["msg"] not in messages:
            messages.append(detail["msg"])
    text = " or ".join(messages)
    return RecipeError(f"{deepest}: {text}" if deepest else text, param=deepest or None)


def validate(model: type[ModelT], data: Any, path: str = "") -> ModelT:
    """Validate `data` (already-decoded JSON) against `model`; errors carry `path` as prefix."""
    if not isinstance(data, dict):
        where = path or "body"
        raise RecipeError(f"{where}: expected a JSON object", param=path or None)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise recipe_error_from(error, path) from None


def require(condition: bool, message: str, param: str | None) -> None:
    if not condition:
        raise RecipeError(f"{param}: {message}" if param else message, param=param)
