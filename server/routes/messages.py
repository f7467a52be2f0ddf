"""POST /v1/messages (Anthropic's Messages API, streaming or not) and
POST /v1/messages/count_tokens.

A request is translated into the chat request it asks for (server/anthropic_api.py) and goes
the chat route's way: the tool plan, the chat template, admission, the engine; its one choice's
answer is read as the chat route reads it (`answer`, `ChoiceStream`) and translated back into
Anthropic's content blocks and events. Errors are Anthropic's shape (server/anthropic_errors.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.loop.async_engine import RequestStream
from server.anthropic_api import MessageEvents, event, message, prefilled, to_chat_request
from server.anthropic_errors import AnthropicRoute, error_body
from server.anthropic_protocol import CountTokensRequest, MessagesRequest, Usage
from server.chat_output import OutputFormat, answer
from server.chat_request import prepare_chat, to_template_messages
from server.context import ServerContext, get_ctx
from server.generation import StreamTracker, answering, collect, merged, start_requests, until_disconnect
from server.routes.common import require_ready
from server.streaming import SSE_HEADERS, sse_body
from server.tools import plan_tools

router = APIRouter(route_class=AnthropicRoute)


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    prepared = await prepare_chat(ctx, to_chat_request(req, ctx.settings), continue_final=prefilled(req))
    admitted, fmt = prepared.admitted, prepared.fmt
    message_id = f"msg_{uuid.uuid4().hex}"
    streams = await start_requests(ctx.engine, message_id, admitted.requests, bool(req.stream),
                                   prompt_param="messages")
    if req.stream:
        body = _events(ctx, MessageEvents(message_id, model, fmt), streams)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, _full(ctx, fmt, message_id, model, streams))


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request) -> dict:
    """The prompt's tokens as /v1/messages would render them (system, messages, tools)."""
    ctx = get_ctx(request)
    require_ready(ctx)
    ctx.check_model(req.model)
    chat = to_chat_request(req, ctx.settings)
    plan = plan_tools(chat, ctx.settings)
    prompt = await ctx.inputs.chat_prompt(to_template_messages(chat.messages), plan, chat.chat_template_kwargs,
                                          prefilled(req))
    return {"input_tokens": len(prompt.token_ids)}


async def _full(ctx: ServerContext, fmt: OutputFormat, message_id: str, model: str,
                streams: list[RequestStream]) -> Response:
    with answering(ctx.engine, streams):
        (output,) = await collect(streams)
        (choice,) = output.outputs
        reply, finish_reason = answer(fmt, choice.text, choice.finish_reason)
        usage = Usage.of(len(output.prompt_token_ids), len(choice.token_ids), output.num_cached_tokens)
        result = message(message_id, model, reply, finish_reason, choice.stop_reason, usage)
        return JSONResponse(result.model_dump())


def _events(ctx: ServerContext, events: MessageEvents, streams: list[RequestStream]) -> AsyncIterator[str]:
    """The stream's body (server/streaming.py `sse_body`): a failure after the headers went out
    becomes an `error` event (which Anthropic's SDK raises); no `[DONE]`."""
    tracker = StreamTracker(1)

    async def frames() -> AsyncIterator[str]:
        async for _, output in merged(streams):
            for delta in tracker.deltas(0, output):
                if delta.first:
                    for frame in events.start(_usage(tracker)):
                        yield frame
                for frame in events.step(delta.text, delta.finish_reason, delta.stop_reason):
                    yield frame
        for frame in events.finish(_usage(tracker)):
            yield frame

    return sse_body(ctx, streams, frames(), tracker, None, done="",
                    error_frame=lambda error: event("error", error_body(error)))


def _usage(tracker: StreamTracker) -> Usage:
    """The usage so far (message_start's counts the output tokens of the first delta)."""
    usage = tracker.usage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Usage.of(usage.prompt_tokens, usage.completion_tokens, cached)

