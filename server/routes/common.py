"""Checks every generating route makes first."""

from __future__ import annotations

from server.context import ServerContext
from server.errors import OpenAIError, from_engine_error


def require_ready(ctx: ServerContext) -> None:
    """503 while draining, loading or after the engine died (no engine access)."""
    if ctx.draining:
        raise OpenAIError(503, "The server is shutting down and accepts no new requests.",
                          code="server_shutting_down")
    try:
        ctx.engine.check_accepting(0)
    except Exception as exc:  # noqa: BLE001
        raise from_engine_error(exc) from None
