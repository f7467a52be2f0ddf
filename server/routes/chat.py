"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs with
top_logprobs, streaming, tool calls (server/tools.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.sampling_params import SamplingParams
from engine.loop.async_engine import RequestStream
from server.admission import PromptSource, admit
from server.context import ServerContext, get_ctx
from server.errors import OpenAIError, bad_request, from_engine_error
from server.generation import StreamTracker, collect, merged, release, sorted_choices, start_requests, until_disconnect
from server.logprobs import chat_logprobs
from server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallResponse,
    ResponseMessage,
    ToolCallResponse,
    UsageInfo,
    now,
    random_id,
)
from server.routes.common import require_ready
from server.streaming import SSE_HEADERS, sse, sse_body
from server.tools import (
    CallStreamer,
    ToolPlan,
    may_be_call,
    new_call_id,
    parse_tool_call,
    partial_call,
    plan_tools,
)

router = APIRouter()


def to_template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain `{role, content}` dicts for the chat template; text parts are joined by newlines,
    a "developer" message becomes a "system" one.
    An assistant message keeps its `tool_calls` (arguments as an object where they parse as
    one, as HF templates expect), a tool message its `tool_call_id` (required) and `name`."""
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
        # NOTE: OpenAI's "developer" role (newer SDKs send it) is the system prompt by another
        # name; chat templates know only "system".
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.role == "tool":
            if not message.tool_call_id:
                raise bad_request("a tool message needs the tool_call_id of the call it answers.",
                                  param=f"messages.{i}.tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request("only assistant messages carry tool_calls.", param=f"messages.{i}.tool_calls")
            entry["tool_calls"] = [{"id": call.id or f"call_{i}_{j}", "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments(call.function.arguments)}}
                                   for j, call in enumerate(message.tool_calls)]
        result.append(entry)
    return result


def _arguments(arguments: str | dict) -> str | dict:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    require_ready(ctx)
    model = ctx.check_model(req.model)
    plan = plan_tools(req, ctx.settings)
    messages = to_template_messages(req.messages)
    admitted = await admit(ctx, req, PromptSource(messages=messages, plan=plan))
    params = admitted.params
    request_id = random_id("chatcmpl")
    streams = await start_requests(ctx.engine, request_id, admitted.requests, bool(req.stream),
                                   prompt_param="messages")
    top_n = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, params, plan, request_id, model, streams, top_n, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(request, ctx, _full(ctx, params, plan, request_id, model, streams, top_n))


def _decode_one(ctx: ServerContext):
    return ctx.inputs.decode_token


def _answer(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ResponseMessage, str | None]:
    """A finished choice's message: a tool call when the plan reads calls and `text` is one.
    A constrained call cut short keeps the engine's finish_reason ("length") and the arguments
    so far, as OpenAI answers a truncated call (and as the stream of it showed)."""
    call = parse_tool_call(text, plan.names) if plan.parses else None
    if call is not None:
        finish_reason = plan.finish_reason
    elif plan.guided is not None:
        call = partial_call(text, plan.names)
    if call is None:
        return ResponseMessage(content=text), finish_reason
    tool_call = ToolCallResponse(id=new_call_id(), function=FunctionCallResponse(name=call[0], arguments=call[1]))
    return ResponseMessage(content=None, tool_calls=[tool_call]), finish_reason


async def _full(ctx: ServerContext, params: SamplingParams, plan: ToolPlan, request_id: str, model: str,
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
            message, finish_reason = _answer(plan, choice.text, choice.finish_reason)
            choices.append(ChatCompletionChoice(index=choice.index, message=message, logprobs=logprobs,
                                                finish_reason=finish_reason, stop_reason=choice.stop_reason))
        prompt_tokens = len(output.prompt_token_ids)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, output.num_cached_tokens)
        response = ChatCompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())
    except (asyncio.CancelledError, OpenAIError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request's failure
        raise from_engine_error(exc, in_flight=True) from None
    finally:
        release(ctx.engine, streams)


class _ToolChoiceStream:
    """One streamed choice of a request whose outputs are read as tool calls.

    Constrained ("required" / named): the call's id and name go out once known, then argument
    fragments (`CallStreamer`). "auto": text is held back while it could still be a whole call
    (it starts with `{` or a fence); once it cannot, it streams as content; held-back text is
    parsed at the end and sent as one tool-call delta, or as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls = CallStreamer(plan.names) if plan.guided is not None else None
        self.held = ""
        self.content = False  # "auto": known to be plain text

    def step(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """DeltaMessage fields for this delta, and the choice's finish_reason."""
        if self.calls is not None:
            return self._constrained(text, finish_reason)
        if self.content:
            return ({"content": text} if text else {}), finish_reason
        self.held += text
        if finish_reason is None:
            if may_be_call(self.held):
                return {}, None
            self.content, held, self.held = True, self.held, ""
            return {"content": held}, None
        call = parse_tool_call(self.held, self.plan.names)
        if call is None:
            return ({"content": self.held} if self.held else {}), finish_reason
        return {"tool_calls": [_delta_call(call[1], name=call[0])]}, self.plan.finish_reason

    def _constrained(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls = self.calls
        announced = calls.name is not None
        name, fragment = calls.feed(text)
        deltas = [_delta_call(fragment, name=name)] if name else ([_delta_call(fragment)] if fragment else [])
        if finish_reason is None:
            return ({"tool_calls": deltas} if deltas else {}), None
        call, rest = calls.finish()
        if calls.name is not None:
            if rest:
                if deltas:
                    deltas[0].function.arguments += rest
                else:
                    deltas.append(_delta_call(rest))
            return ({"tool_calls": deltas} if deltas else {}), (self.plan.finish_reason if call else finish_reason)
        if call is not None:  # a call whose head the streamer could not read (not expected)
            return {"tool_calls": [_delta_call(call[1], name=call[0])]}, self.plan.finish_reason
        assert not announced
        return ({"content": calls.text} if calls.text else {}), finish_reason


def _delta_call(arguments: str, name: str | None = None) -> DeltaToolCall:
    if name is None:
        return DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))
    return DeltaToolCall(index=0, id=new_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def _stream(ctx: ServerContext, params: SamplingParams, plan: ToolPlan, request_id: str, model: str,
            streams: list[RequestStream], top_n: int, include_usage: bool) -> AsyncIterator[str]:
    created = now()
    tracker = StreamTracker(params.n)
    tool_streams: dict[int, _ToolChoiceStream] = {}

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
                if not plan.parses:
                    message, finish_reason = DeltaMessage(role=role, content=delta.text), delta.finish_reason
                else:
                    state = tool_streams.setdefault(delta.index, _ToolChoiceStream(plan))
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
