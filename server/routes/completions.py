"""POST /v1/completions: one or many prompts (text or token ids), n choices each, echo,
logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.loop.async_engine import RequestStream
from server.admission import PromptSource, admit
from server.context import ServerContext, get_ctx
from server.generation import (StreamTracker, answering, collect, merged, sorted_choices, start_requests,
                               until_disconnect)
from server.logprobs import completion_logprobs
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    now,
    random_id,
)
from server.routes.common import require_ready
from server.streaming import SSE_HEADERS, sse, sse_body

router = APIRouter()


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each a text or a list of token ids (an empty list is one empty
    prompt). Only their shape is read here: admission checks them (server/admission.py)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(req: CompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    admitted = await admit(ctx, req, PromptSource(prompts=_prompts(req), echo=bool(req.echo)))
    params, inputs = admitted.params, admitted.requests
    request_id = random_id("cmpl")
    streams = await start_requests(ctx.engine, request_id, inputs, bool(req.stream))
    echo_texts = [p.text or "" for p in inputs] if req.echo else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, req, params, request_id, model, streams, echo_texts, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, _full(ctx, req, params, request_id, model, streams, echo_texts))


def _decode_one(ctx: ServerContext):
    return ctx.inputs.decode_token


async def _logprobs(ctx: ServerContext, output: RequestOutput, entries: list, token_ids: list[int],
                    echo: str | None, offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs of `token_ids` with text offsets from `offset`; with `echo` (the prompt's text,
    on a choice's first chunk) the prompt's tokens come first. Returns the offset after them.
    NOTE: the prompt's part (up to max_model_len positions x max_logprobs + 1 alternatives,
    their texts decoded here, not on the engine thread) is built on a worker thread."""
    decode = _decode_one(ctx)
    if echo is None:
        return completion_logprobs(entries, token_ids, decode, offset)

    def with_prompt() -> tuple[CompletionLogprobs, int]:
        prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        head, _ = completion_logprobs(prompt_entries, output.prompt_token_ids, decode, 0)
        tail, end = completion_logprobs(entries, token_ids, decode, len(echo))
        for field in CompletionLogprobs.model_fields:
            getattr(head, field).extend(getattr(tail, field))
        return head, end

    return await ctx.inputs.off_loop(with_prompt)


async def _full(ctx: ServerContext, req: CompletionRequest, params: SamplingParams, request_id: str,
                model: str, streams: list[RequestStream], echo_texts: list[str] | None) -> Response:
    with answering(ctx.engine, streams):
        finals = await collect(streams)
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for p, output in enumerate(finals):
            prompt_tokens += len(output.prompt_token_ids)
            cached_tokens += output.num_cached_tokens
            for choice in sorted_choices(output):
                completion_tokens += len(choice.token_ids)
                echo = echo_texts[p] if echo_texts is not None else None
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = await _logprobs(ctx, output, choice.logprobs or [], choice.token_ids, echo, 0)
                choices.append(CompletionChoice(index=p * params.n + choice.index, text=(echo or "") + choice.text,
                                                logprobs=logprobs, finish_reason=choice.finish_reason,
                                                stop_reason=choice.stop_reason))
        choices.sort(key=lambda c: c.index)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)
        response = CompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        if echo_texts is not None and params.logprobs is not None:
            # NOTE: with the prompt's logprobs the body grows with the prompt: encoded off the loop
            return await ctx.inputs.off_loop(lambda: JSONResponse(response.model_dump()))
        return JSONResponse(response.model_dump())


def _stream(ctx: ServerContext, req: CompletionRequest, params: SamplingParams, request_id: str,
            model: str, streams: list[RequestStream], echo_texts: list[str] | None,
            include_usage: bool) -> AsyncIterator[str]:
    created = now()
    tracker = StreamTracker(params.n)
    offsets: dict[int, int] = {}

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                            usage=usage), include_usage=include_usage)

    async def choice_chunks() -> AsyncIterator[str]:
        async for p, output in merged(streams):
            choices = []
            for delta in tracker.deltas(p, output):
                echo = echo_texts[p] if echo_texts is not None and delta.first else None
                text, logprobs = (echo or "") + delta.text, None
                if params.logprobs is not None:
                    logprobs, offsets[delta.index] = await _logprobs(ctx, output, delta.logprobs or [],
                                                                     delta.token_ids, echo, offsets.get(delta.index, 0))
                choices.append(CompletionChoice(index=delta.index, text=text, logprobs=logprobs,
                                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
            if choices:
                yield chunk(choices)

    usage_chunk = (lambda usage: chunk([], usage)) if include_usage else None
    return sse_body(ctx, streams, choice_chunks(), tracker, usage_chunk)
