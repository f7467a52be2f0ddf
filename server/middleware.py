"""Pure-ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect
detection): API-key auth and the request body size limit."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import OpenAIError


async def _send_error(send: Send, error: OpenAIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on every route but the open ones."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = set(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "Missing API key: send 'Authorization: Bearer <key>'." if not given else "Incorrect API key provided."
            return await _send_error(send, OpenAIError(401, message, code="invalid_api_key",
                                                       headers={"WWW-Authenticate": "Bearer"}))
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """400 for a request body over `max_bytes`. Bodies are read whole (ours are small JSON) and
    replayed to the app; later `receive()` calls pass through, so disconnects are still seen."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int) -> OpenAIError:
        return OpenAIError(400, f"The request body is too large: {size} bytes exceeds the limit of "
                                f"{self.max_bytes} bytes (--max-request-body-bytes).", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, self._too_large(int(length)))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
