"""Server-sent events: `data: {json}\n\n` frames, the closing `data: [DONE]`, an error frame for
a stream that fails after its headers went out, and `sse_body`, the ending every streaming route
shares."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel

from engine.loop.async_engine import RequestStream
from server.context import ServerContext
from server.errors import OpenAIError, from_engine_error
from server.generation import StreamTracker, release
from server.protocol import UsageInfo

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(chunk: BaseModel, *, include_usage: bool) -> str:
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


async def sse_body(ctx: ServerContext, streams: list[RequestStream], chunks: AsyncIterator[str],
                   tracker: StreamTracker, usage_chunk: Callable[[UsageInfo], str] | None,
                   done: str = DONE, error_frame: Callable[[OpenAIError], str] = sse_error) -> AsyncIterator[str]:
    """A streaming response's body: the route's choice `chunks` (SSE frames read from `streams`
    through `tracker`), then, if `usage_chunk` is given, the frame it makes of the usage counted by
    `tracker` once `chunks` is exhausted, then `done` (`data: [DONE]`; "" for APIs without one).

    A failure after the headers went out becomes the in-band `error_frame(error)` and `done`; a
    client disconnect (cancellation) is counted and re-raised. `streams` are released on every path."""
    try:
        async for chunk in chunks:
            yield chunk
        if usage_chunk is not None:
            yield usage_chunk(tracker.usage())
        if done:
            yield done
    except asyncio.CancelledError:
        ctx.client_disconnected()
        raise
    except Exception as exc:  # noqa: BLE001 - headers are out: report in-band
        error = exc if isinstance(exc, OpenAIError) else from_engine_error(exc, in_flight=True)
        yield error_frame(error)
        if done:
            yield done
    finally:
        release(ctx.engine, streams)
