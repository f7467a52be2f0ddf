"""Server-sent events: `data: {json}\n\n` frames, the closing `data: [DONE]`, and an error
frame for a stream that fails after its headers went out."""

from __future__ import annotations

import json

from pydantic import BaseModel

from server.errors import OpenAIError

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(chunk: BaseModel, *, include_usage: bool) -> str:
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
