"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs with
top_logprobs, streaming, tool calls (server/tools.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.sampling_params import SamplingParams
from engine.loop.async_engine import RequestStream
from server.context import ServerContext, get_ctx
from server.generation import (StreamTracker, answering, collect, merged, sorted_choices, start_requests,
                               until_disconnect)
from server.logprobs import chat_logprobs
from server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    now,
    random_id,
)
from server.routes.common import require_ready
from server.streaming import SSE_HEADERS, sse, sse_body
from server.chat_output import ChoiceStream, OutputFormat, answer
from server.chat_request import prepare_chat

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    prepared = await prepare_chat(ctx, req)
    admitted, fmt = prepared.admitted, prepared.fmt
    params = admitted.params
    request_id = random_id("chatcmpl")
    streams = await start_requests(ctx.engine, request_id, admitted.requests, bool(req.stream),
                                   prompt_param="messages")
    top_n = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, params, fmt, request_id, model, streams, top_n, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, _full(ctx, params, fmt, request_id, model, streams, top_n))


def _decode_one(ctx: ServerContext):
    return ctx.inputs.decode_token


async def _full(ctx: ServerContext, params: SamplingParams, fmt: OutputFormat, request_id: str, model: str,
                streams: list[RequestStream], top_n: int) -> Response:
    with answering(ctx.engine, streams):
        (output,) = await collect(streams)
        choices, completion_tokens = [], 0
        for choice in sorted_choices(output):
            completion_tokens += len(choice.token_ids)
            logprobs = None
            if params.logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(choice.logprobs or [], choice.token_ids,
                                                                    _decode_one(ctx), top_n))
            message, finish_reason = answer(fmt, choice.text, choice.finish_reason)
            choices.append(ChatCompletionChoice(index=choice.index, message=message, logprobs=logprobs,
                                                finish_reason=finish_reason, stop_reason=choice.stop_reason))
        prompt_tokens = len(output.prompt_token_ids)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, output.num_cached_tokens)
        response = ChatCompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())


def _stream(ctx: ServerContext, params: SamplingParams, fmt: OutputFormat, request_id: str, model: str,
            streams: list[RequestStream], top_n: int, include_usage: bool) -> AsyncIterator[str]:
    created = now()
    tracker = StreamTracker(params.n)
    choice_streams: dict[int, ChoiceStream] = {}

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
                role = "assistant" if delta.first else None
                if fmt.plain:
                    message, finish_reason = DeltaMessage(role=role, content=delta.text), delta.finish_reason
                else:
                    state = choice_streams.setdefault(delta.index, ChoiceStream(fmt))
                    fields, finish_reason = state.step(delta.text, delta.finish_reason)
                    if not (fields or role or finish_reason or logprobs):
                        continue
                    message = DeltaMessage(role=role, **fields)
                choices.append(ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                                                finish_reason=finish_reason, stop_reason=delta.stop_reason))
            if choices:
                yield chunk(choices)

    usage_chunk = (lambda usage: chunk([], usage)) if include_usage else None
    return sse_body(ctx, streams, choice_chunks(), tracker, usage_chunk)
