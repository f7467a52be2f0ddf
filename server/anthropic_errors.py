"""Anthropic-shaped errors on the /v1/messages routes:
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.

The rest of the server raises `OpenAIError`; here each one is answered in Anthropic's shape
instead, with the same status and headers: by `AnthropicRoute` for what a route raises (its
body's validation included), by the middleware (server/middleware.py) for what it refuses
before the route runs (the API key, the body's size), through `error_response`. The field at
fault, which Anthropic's body has no place for, leads the message ("max_tokens: ..."), under its
Anthropic name (`anthropic_param`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import OpenAIError, from_engine_error, validation_error

PATH_PREFIX = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

# The chat path's field names (server/sampling.py, server/tools.py, server/structured.py) for
# the Anthropic fields they were translated from (server/anthropic_api.py).
_RENAMES = [(re.compile(r"^tools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
            (re.compile(r"^tools\.(\d+)\.function"), r"tools.\1"),
            (re.compile(r"^stop$"), "stop_sequences"),
            (re.compile(r"^max_completion_tokens$"), "max_tokens"),
            (re.compile(r"^response_format"), "output_config.format")]


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_param(param: str) -> str:
    """An error's field under its Anthropic name."""
    for pattern, replacement in _RENAMES:
        param, changed = pattern.subn(replacement, param)
        if changed:
            break
    return param


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error: OpenAIError) -> dict:
    message = error.message
    if error.param:
        param = anthropic_param(error.param)
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}


def error_response(error: OpenAIError) -> Response:
    # NOTE: ASCII JSON, as OpenAIError.response: a message may quote any text the client sent.
    return Response(json.dumps(error_body(error), separators=(",", ":")), status_code=error.status,
                    headers=error.headers, media_type="application/json")


def as_openai_error(exc: Exception) -> OpenAIError:
    """Whatever a route raised, as the OpenAIError the app-wide handlers would make of it."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    if isinstance(exc, StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return OpenAIError(exc.status_code, detail, headers=getattr(exc, "headers", None))
    return from_engine_error(exc)


class AnthropicRoute(APIRoute):
    """A route whose errors (validation, OpenAIError, engine errors, internal ones) are answered in
    Anthropic's shape. Cancellation (a client gone) passes through."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - each becomes its 4xx/5xx, as the app's handlers do
                return error_response(as_openai_error(exc))

        return route
