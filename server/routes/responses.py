"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items.

A request is translated into a chat request (server/responses_api.py) and goes the chat path
(server/chat_request.py: messages, tools, admission, structured outputs), one choice; its
answer comes back as Responses output items, or streamed as Responses events
(server/responses_events.py). With `store` (the default) the response and its conversation are
kept (server/responses_store.py), so that `previous_response_id` continues it; an unknown or
evicted id is a 404.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine.loop.async_engine import RequestStream
from server.chat_output import ChoiceStream, OutputFormat, answer
from server.chat_request import prepare_chat
from server.context import ServerContext, get_ctx
from server.errors import OpenAIError, bad_request, shown
from server.generation import (StreamTracker, answering, collect, merged, sorted_choices, start_requests,
                               until_disconnect)
from server.protocol import UsageInfo
from server.responses_api import ResponsesRequest, check_unsupported, history_messages, new_id, renamed, to_chat
from server.responses_output import output_items, output_messages, response_object, status_of, usage
from server.responses_events import ResponseEvents
from server.responses_store import StoredResponse, input_item_list, input_items_page
from server.routes.common import require_ready
from server.streaming import SSE_HEADERS, sse_body

router = APIRouter()
MIN_PAGE, MAX_PAGE = 1, 100  # input_items' limit, as OpenAI bounds it


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    check_unsupported(req)
    history = await _history(ctx, req.previous_response_id)
    chat, conversation, origins = to_chat(req, history)
    rid = new_id("resp")
    try:
        prepared = await prepare_chat(ctx, chat)
        streams = await start_requests(ctx.engine, rid, prepared.admitted.requests, bool(req.stream),
                                       prompt_param="messages")
    except OpenAIError as exc:
        raise renamed(exc, origins) from None
    run = _Run(ctx, req, rid, model, time.time(), prepared.fmt, streams, conversation)
    if req.stream:
        events = ResponseEvents(rid, req, model, run.created)
        body = sse_body(ctx, streams, run.events(events), StreamTracker(1), None, done="", error_frame=events.failed)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, run.full())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    stored = await asyncio.to_thread(get_ctx(request).responses.get, response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not await asyncio.to_thread(get_ctx(request).responses.delete, response_id):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                           after: str | None = None) -> Response:
    """A stored response's input items, a page at a time (OpenAI's list object)."""
    if not MIN_PAGE <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be between {MIN_PAGE} and {MAX_PAGE}, got {limit}.", param="limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got '{shown(order)}'.", param="order")
    stored = await asyncio.to_thread(get_ctx(request).responses.get, response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    page = input_items_page(stored.input_items, limit, order, after)
    if page is None:
        raise bad_request(f"after names no input item of this response: '{shown(after)}'.", param="after")
    return JSONResponse(page)


def _not_found(rid: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"No response with id '{shown(rid)}' is stored (never stored, deleted or evicted).",
                       param=param, code="response_not_found")


async def _history(ctx: ServerContext, previous: str | None) -> list[dict]:
    """The stored conversation `previous` continues (ChatMessage dicts); 404 if not stored."""
    if previous is None:
        return []
    stored = await asyncio.to_thread(ctx.responses.get, previous)
    if stored is None:
        raise _not_found(previous, "previous_response_id")
    try:
        return history_messages(stored.messages)
    except ValidationError:
        raise OpenAIError(500, f"The stored conversation of '{shown(previous)}' cannot be read; see the server "
                               "log.", code="internal_error") from None


class _Run:
    """One admitted response: its engine stream read whole (`full`) or as events (`events`),
    then stored if asked."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, rid: str, model: str, created: float,
                 fmt: OutputFormat, streams: list[RequestStream], conversation: list[dict]) -> None:
        self.ctx, self.req, self.rid, self.model, self.created = ctx, req, rid, model, created
        self.fmt, self.streams, self.conversation = fmt, streams, conversation

    async def full(self) -> Response:
        with answering(self.ctx.engine, self.streams):
            (output,) = await collect(self.streams)
            (choice,) = sorted_choices(output)
            message, finish_reason = answer(self.fmt, choice.text, choice.finish_reason)
            status, incomplete = status_of(finish_reason)
            info = UsageInfo.of(len(output.prompt_token_ids), len(choice.token_ids), output.num_cached_tokens)
            items = output_items(message, "incomplete" if incomplete else "completed", self.req.max_tool_calls)
            reasoning = await self._reasoning_tokens(choice.token_ids) if message.reasoning_content is not None else 0
            response = response_object(self.rid, self.req, self.model, self.created, status, items,
                                       usage_info=usage(info, reasoning), incomplete=incomplete)
            await self._store(response)
            return JSONResponse(response)

    async def events(self, events: ResponseEvents) -> AsyncIterator[str]:
        """The event frames (sse_body ends the stream, releases it, reports a failure)."""
        for frame in events.start():
            yield frame
        tracker, stream, finish_reason = StreamTracker(1), ChoiceStream(self.fmt), None
        token_ids: list[int] = []
        async for p, output in merged(self.streams):
            for delta in tracker.deltas(p, output):
                token_ids += delta.token_ids
                fields, finish = stream.step(delta.text, delta.finish_reason)
                finish_reason = finish or finish_reason
                for frame in events.step(fields):
                    yield frame
        reasoning = await self._reasoning_tokens(token_ids)
        frames, response = events.finish(finish_reason, usage(tracker.usage(), reasoning))
        await self._store(response)
        for frame in frames:
            yield frame

    async def _reasoning_tokens(self, token_ids: list[int]) -> int:
        if self.fmt.think is None:
            return 0
        return await self.ctx.inputs.reasoning_tokens(self.fmt.think, self.fmt.opened, token_ids)

    async def _store(self, response: dict) -> None:
        if not self.req.store:
            return
        record = StoredResponse(response, self.conversation + output_messages(response["output"]),
                                input_item_list(self.req.input))
        await asyncio.to_thread(self.ctx.responses.put, self.rid, record)
