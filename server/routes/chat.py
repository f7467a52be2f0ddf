"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs with
top_logprobs, streaming."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import RequestStream
from engine.sampling_params import SamplingParams
from server.context import ServerContext, get_ctx
from server.errors import OpenAIError, bad_request, from_engine_error
from server.generation import DeltaTracker, collect, merged, release, sorted_choices, start_requests, until_disconnect
from server.logprobs import chat_logprobs
from server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    ResponseMessage,
    UsageInfo,
    now,
    random_id,
)
from server.routes.common import require_ready
from server.sampling import chat_params
from server.streaming import SSE_HEADERS, sse, sse_body

router = APIRouter()


def to_template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain `{role, content}` dicts for the chat template; text parts are joined by newlines."""
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Only text content parts are supported, got type {part.type!r}.",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        result.append({"role": message.role, "content": content or ""})
    return result


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    messages = to_template_messages(req.messages)
    params = chat_params(req, ctx.settings, ctx.vocab_size)
    template = ctx.settings.chat_template
    request_id = random_id("chatcmpl")
    streams = await start_requests(ctx.engine, request_id, [lambda e: e.chat_prompt(messages, template)], params,
                                   prompt_param="messages")
    top_n = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, params, request_id, model, streams, top_n, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, _full(ctx, params, request_id, model, streams, top_n))


def _decode_one(ctx: ServerContext):
    return lambda token_id: ctx.tokenizer.decode([token_id])


async def _full(ctx: ServerContext, params: SamplingParams, request_id: str, model: str,
                streams: list[RequestStream], top_n: int) -> Response:
    try:
        (output,) = await collect(streams)
        choices, completion_tokens = [], 0
        for choice in sorted_choices(output):
            completion_tokens += len(choice.token_ids)
            logprobs = None
            if params.logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(choice.logprobs or [], choice.token_ids,
                                                                    _decode_one(ctx), top_n))
            choices.append(ChatCompletionChoice(index=choice.index, message=ResponseMessage(content=choice.text),
                                                logprobs=logprobs, finish_reason=choice.finish_reason,
                                                stop_reason=choice.stop_reason))
        prompt_tokens = len(output.prompt_token_ids)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        response = ChatCompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())
    except (asyncio.CancelledError, OpenAIError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request's failure
        raise from_engine_error(exc, in_flight=True) from None
    finally:
        release(ctx.engine, streams)


def _stream(ctx: ServerContext, params: SamplingParams, request_id: str, model: str,
            streams: list[RequestStream], top_n: int, include_usage: bool) -> AsyncIterator[str]:
    created = now()
    tracker = DeltaTracker(params.n)

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                usage=usage), include_usage=include_usage)

    async def choice_chunks() -> AsyncIterator[str]:
        async for p, output in merged(streams):
            choices = []
            for delta in tracker.deltas(p, output):
                logprobs = None
                if params.logprobs is not None:
                    logprobs = ChatChoiceLogprobs(content=chat_logprobs(delta.logprobs or [], delta.token_ids,
                                                                        _decode_one(ctx), top_n))
                message = DeltaMessage(role="assistant" if delta.first else None, content=delta.text)
                choices.append(ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
            if choices:
                yield chunk(choices)

    usage_chunk = (lambda usage: chunk([], usage)) if include_usage else None
    return sse_body(ctx, streams, choice_chunks(), tracker, usage_chunk)
