"""The FastAPI application: routes plus error handlers that answer in each API's own shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.recipe.errors import RecipeError
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.server import anthropic_routes, misc_routes, openai_routes, pd_routes, responses_routes
from deepinfer.server.errors import ApiError, error_response, flavor_of
from deepinfer.server.state import ServerState

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"


class RequestIdEcho:
    """Answers carry the `x-request-id` the client (or a router in front) sent, so one id
    follows a request through every hop's logs. Pure ASGI: streams pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(misc_routes.router)
    app.include_router(pd_routes.router)
    app.add_middleware(RequestIdEcho)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(error, flavor_of(request.url.path))

    @app.exception_handler(RecipeError)
    async def recipe_error(request: Request, error: RecipeError) -> JSONResponse:
        return error_response(ApiError(400, str(error), param=error.param), flavor_of(request.url.path))

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
        return error_response(ApiError(400, str(error), param=error.param), flavor_of(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(ApiError(error.status_code, message), flavor_of(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, str(error)), flavor_of(request.url.path))

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, error: RecursionError) -> JSONResponse:
        # read_json bounds a body's nesting; this catches what nests deeper once parsed.
        message = "the request is nested too deeply to process"
        return error_response(ApiError(400, message, param="body"), flavor_of(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        # Details go to the log, not to the client.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal server error"), flavor_of(request.url.path))

    return app
