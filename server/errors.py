"""OpenAI-shaped errors: one exception type for the handlers, and the app-wide handlers that turn
every failure (validation, unknown route, engine state, internal bugs) into
`{"error": {"message", "type", "param", "code"}}` with the right status.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.request_error import RequestError
from engine.loop.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestCancelledError,
    RequestFailedError,
    RequestInvalidError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 429 / 503 tells clients to wait


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # NOTE: ASCII JSON (not JSONResponse's UTF-8): a message that quotes the client's text
        # stays encodable whatever that text holds (a lone surrogate cannot be UTF-8).
        return Response(json.dumps(self.body(), separators=(",", ":")), status_code=self.status,
                        headers=self.headers, media_type="application/json")


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def shown(text: str, limit: int = 256) -> str:
    """`text` as an error message quotes it: at most `limit` characters (then "..."), so that a
    huge name or id sent by a client never comes back whole."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_request_error(exc: ValueError, prompt_param: str = "prompt") -> OpenAIError:
    """400 for a request the engine refused: a `RequestError` names its own `param` and `code`
    (its "prompt" is `prompt_param` here: chat's prompt is its "messages"); any other ValueError
    (a bug's, or a library's) names no field."""
    if not isinstance(exc, RequestError):
        return bad_request(str(exc))
    param = prompt_param if exc.param == "prompt" else exc.param
    return bad_request(exc.message, param=param, code=exc.code)


def from_engine_error(exc: BaseException, *, in_flight: bool = False) -> OpenAIError:
    """Map the async engine's errors: before a request starts (503/429) or while it runs (500).

    NOTE: what went wrong inside (exception text, type names) goes to the log, never to the
    client: a 500 or a dead engine's 503 says only where to look."""
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineNotReadyError):
        return OpenAIError(503, str(exc), code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestCancelledError):
        return OpenAIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        # The engine logged why it stopped when it did.
        if in_flight:
            return OpenAIError(500, "The engine stopped while generating; see the server log.", code="engine_dead")
        return OpenAIError(503, "The engine is not running; see the server log.", code="engine_dead")
    if isinstance(exc, RequestInvalidError):
        return bad_request(str(exc))
    if isinstance(exc, RequestFailedError):
        logger.error("a request failed inside the engine: %s", exc)
        return OpenAIError(500, "Internal error while generating; see the server log.", code="internal_error")
    logger.error("internal error while handling a request", exc_info=exc)
    return OpenAIError(500, "Internal server error; see the server log.", code="internal_error")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The 400 for a request body that failed validation, naming the first field at fault."""
    message, param = _validation_message(exc)
    return bad_request(message, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"Malformed JSON in the request body: {ctx.get('error', 'invalid JSON')}.", None
    # NOTE: loc starts with where the field is (body, query, path): the field is named without it
    loc = [str(part) for part in first.get("loc", ())]
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
    # NOTE: pydantic puts union member names in loc (e.g. 'str', 'list[int]'); keep the field path.
    loc = [part for part in loc if not (part.startswith(("list[", "dict[")) or part in ("str", "int", "float", "bool"))]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and param:
        return f"Missing required parameter: '{param}'.", param
    if first.get("type") == "model_attributes_type" and not loc:
        return "The request body must be a JSON object.", None
    msg = first.get("msg", "Invalid value").removeprefix("Value error, ")
    more = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"Invalid value for '{param}': {msg}{more}." if param else f"{msg}{more}."), param


def install_error_handlers(app: FastAPI, shapes: tuple = ()) -> None:
    """The app-wide handlers: every error as an OpenAI error body. `shapes`: (path predicate,
    responder) pairs for routes that answer in another API's shape (Anthropic's /v1/messages):
    an unknown path or method under them (404, 405) is answered by their responder."""
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == phrase:
            message = "Not found: no such route."
        error = OpenAIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        for matches, respond in shapes:
            if matches(request.url.path):
                return respond(error)
        return error.response()

    for engine_error in (EngineDeadError, EngineNotReadyError, QueueFullError, RequestFailedError,
                         RequestCancelledError):
        app.add_exception_handler(engine_error, _engine_error)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        return from_engine_error(exc).response()


async def _engine_error(_: Request, exc: Exception) -> Response:
    return from_engine_error(exc).response()
