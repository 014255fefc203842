"""Error bodies in each API's shape, for HTTP errors and for errors inside a stream."""

from __future__ import annotations

from typing import Any

from deepinfer.recipe.errors import RecipeError

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    529: "server_error",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def openai_error_type(status: int) -> str:
    if status in _OPENAI_TYPES:
        return _OPENAI_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def openai_error_body(
    message: str, *, status: int = 400, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, used by Chat Completions and Responses."""
    return {"error": {"message": message, "type": openai_error_type(status), "param": param, "code": code}}


def anthropic_error_body(message: str, *, status: int = 400) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the Messages API's shape."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def openai_error_from(error: RecipeError) -> dict[str, Any]:
    return openai_error_body(str(error), status=400, param=error.param)


def anthropic_error_from(error: RecipeError) -> dict[str, Any]:
    return anthropic_error_body(str(error), status=400)
