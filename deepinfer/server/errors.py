"""HTTP errors, rendered in the shape of the API the client speaks.

Paths under /v1/messages answer like Anthropic (`{"type": "error", "error": {...}}`, 529 when
overloaded); everything else answers like OpenAI (`{"error": {message, type, param, code}}`).
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse

from deepinfer.recipe.api import anthropic_error_body, openai_error_body

Flavor = Literal["openai", "anthropic"]


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def flavor_of(path: str) -> Flavor:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(error: ApiError, flavor: Flavor) -> JSONResponse:
    if flavor == "anthropic":
        body = anthropic_error_body(error.message, status=error.status)
    else:
        body = openai_error_body(error.message, status=error.status, param=error.param, code=error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def overloaded(flavor: Flavor, num_waiting: int, limit: int) -> ApiError:
    """Too many requests waiting: 429 for OpenAI clients, 529 overloaded_error for Anthropic ones."""
    message = (
        f"the server is overloaded: {num_waiting} requests are waiting for the engine "
        f"(limit {limit}); retry later"
    )
    status = 529 if flavor == "anthropic" else 429
    return ApiError(status, message, code="server_overloaded", headers={"retry-after": "1"})
