"""Pure-ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect
detection): API-key auth, and the request body's size limit and JSON checks."""

from __future__ import annotations

import gc
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.anthropic_errors import error_response, is_anthropic_path
from server.errors import OpenAIError, bad_request
from server.protocol import JsonTooDeep, JsonValueError, check_json_value


async def _send_error(scope: Scope, send: Send, error: OpenAIError) -> None:
    """`error` in the shape of the API the path belongs to (Anthropic's on /v1/messages)."""
    response = error_response(error) if is_anthropic_path(scope.get("path", "")) else error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope["headers"] if key == name]


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header)
    matches, on every route but the open ones; a request that gives both must give the key in
    both. The scheme is case-insensitive (RFC 7235); a request that gives a header more than once
    is refused (which of the keys would count is not something to guess)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = api_key.encode()
        # NOTE: an entry ending in "/" opens every path under it (/kv/requests/{id})
        self.open_paths = {p for p in open_paths if not p.endswith("/")}
        self.open_prefixes = tuple(p for p in open_paths if p.endswith("/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or path in self.open_paths
                or (self.open_prefixes and path.startswith(self.open_prefixes))):
            return await self.app(scope, receive, send)
        given = _header_values(scope, b"authorization")
        api_keys = _header_values(scope, b"x-api-key")
        for header, values in ((b"Authorization", given), (b"x-api-key", api_keys)):
            if len(values) > 1:
                return await _send_error(scope, send, _unauthorized(
                    f"The {header.decode()} header must be given once, got {len(values)}."))
        if not (given or api_keys):
            return await _send_error(scope, send, _unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."))
        ok = True
        if given:
            scheme, _, key = given[0].strip().partition(b" ")
            # NOTE: compare_digest on every path, so the answer's timing does not tell the scheme apart.
            matches = hmac.compare_digest(key.lstrip(b" "), self.expected)
            ok = scheme.lower() == b"bearer" and matches
        if api_keys:
            ok = hmac.compare_digest(api_keys[0].strip(), self.expected) and ok
        if not ok:
            return await _send_error(scope, send, _unauthorized("Incorrect API key provided."))
        return await self.app(scope, receive, send)


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """Request bodies: 413 for one over `max_bytes` (by its Content-Length, or as a chunked body
    grows past it), then, for a JSON body, a 400 for what Python's parser gets wrong
    (`json_body_error`). Bodies are read whole (ours are small JSON) and replayed to the app;
    later `receive()` calls pass through, so disconnects are still seen."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_depth: int,
                 max_counts: dict[str, tuple[int, str]] | None = None) -> None:
        """`max_counts`: top-level field -> (most items, what an item is called): a body over
        one is refused here, before it is validated item by item (which costs ~4 us an item
        on the event loop: half a second for a 4 MiB list of tiny messages)."""
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_depth = max_json_depth
        self.max_counts = max_counts or {}

    def _too_large(self, size: int) -> OpenAIError:
        return OpenAIError(413, f"The request body is too large: {size} bytes exceeds the limit of "
                                f"{self.max_bytes} bytes (--max-request-body-bytes).", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        lengths = _header_values(scope, b"content-length")
        if lengths and lengths[0].isdigit() and int(lengths[0]) > self.max_bytes:
            return await _send_error(scope, send, self._too_large(int(lengths[0])))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(scope, send, self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and _is_json(scope):
            error = json_body_error(body, self.max_json_depth, self.max_counts)
            if error is not None:
                return await _send_error(scope, send, error)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _is_json(scope: Scope) -> bool:
    """Whether FastAPI will parse the body as JSON (application/json or application/*+json)."""
    types = _header_values(scope, b"content-type")
    if not types:
        return False
    media = types[0].split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class _NonStandardConstant(ValueError):
    pass


def _reject_constant(name: str) -> float:
    raise _NonStandardConstant(name)


def _parse(body: bytes):
    # NOTE: without the cyclic GC while parsing: a body of a million small arrays otherwise
    # triggers collection after collection (4-5x slower); parsed JSON holds no cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(body, parse_constant=_reject_constant)
    finally:
        if enabled:
            gc.enable()


def json_body_error(body: bytes, max_depth: int,
                    max_counts: dict[str, tuple[int, str]] | None = None) -> OpenAIError | None:
    """A 400 for a JSON body that Python's parser rejects with something other than a syntax
    error (FastAPI answers those itself, with their position) or lets through although it is not
    valid JSON for us: NaN / Infinity literals, nesting too deep for the parser or over
    `max_depth`, an integer over Python's 4300 digits, invalid UTF-8, a number that overflows to
    infinity (1e400), a lone UTF-16 surrogate (\\ud800). The param is the top-level field.

    NOTE: FastAPI parses the body again; parsing twice is linear and bounded by the body limit,
    and it keeps FastAPI's own parsing (and its errors) as they are."""
    try:
        value = _parse(body)
    except _NonStandardConstant as exc:
        return bad_request(f"Malformed JSON in the request body: {exc} is not a JSON number.")
    except json.JSONDecodeError:
        return None
    except UnicodeDecodeError:
        return bad_request("Malformed JSON in the request body: it is not valid UTF-8.")
    except RecursionError:
        return _too_deep(max_depth, None)
    except ValueError:  # int() of over 4300 digits (sys.int_info.default_max_str_digits)
        return bad_request("Malformed JSON in the request body: an integer has too many digits.")
    fields = value.items() if isinstance(value, dict) else [(None, value)]
    for key, (limit, items) in (max_counts or {}).items():
        given = value.get(key) if isinstance(value, dict) else None
        if isinstance(given, (list, dict)) and len(given) > limit:
            return bad_request(f"{key} may hold at most {limit} {items}, got {len(given)}.", param=key)
    for key, field in fields:
        try:
            check_json_value(key, 0)
        except JsonValueError as exc:
            return bad_request(f"Invalid field name in the request body: {exc}.")
        try:
            check_json_value(field, max_depth - 1)
        except JsonTooDeep:
            return _too_deep(max_depth, key or None)
        except JsonValueError as exc:
            return bad_request(f"Invalid value for '{key}': {exc}." if key else f"Invalid request body: {exc}.",
                               param=key or None)
    return None


def _too_deep(max_depth: int, param: str | None) -> OpenAIError:
    return bad_request(f"The request body nests arrays and objects more than {max_depth} levels deep "
                       "(--max-json-depth).", param=param)
