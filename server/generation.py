"""What completions and chat share: starting one engine request per prompt, reading their
outputs merged, turning cumulative outputs into per-choice deltas, and aborting everything when
the client goes away (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from engine.async_engine import AsyncEngine, PromptLike, RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from server.context import ServerContext
from server.errors import OpenAIError, from_engine_error, from_value_error
from server.protocol import UsageInfo


async def start_requests(engine: AsyncEngine, base_id: str, prompts: list[PromptLike],
                         params: SamplingParams, prompt_param: str = "prompt") -> list[RequestStream]:
    """Add one engine request per prompt (ids `{base_id}-{i}`); all or nothing.

    Raises OpenAIError: 400 for the engine's ValueError (e.g. the context length), 429/503 for
    the engine's state."""
    try:
        engine.check_accepting(len(prompts))
    except Exception as exc:  # noqa: BLE001
        raise from_engine_error(exc) from None
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await engine.add_request(f"{base_id}-{i}", prompt, params, checked=True))
    except BaseException as exc:
        release(engine, streams)
        if isinstance(exc, ValueError):
            raise from_value_error(exc, prompt_param) from None
        if isinstance(exc, (OpenAIError, asyncio.CancelledError)):
            raise
        raise from_engine_error(exc) from None
    return streams


def release(engine: AsyncEngine, streams: list[RequestStream]) -> None:
    """Abort every stream not read to its end, and forget them all."""
    for stream in streams:
        engine.release(stream.request_id)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive; an error in any stream ends it."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class ChoiceCursor:
    """How much of one choice has been sent already."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass
class Delta:
    index: int  # the choice index in the response: prompt index * n + output index
    text: str
    token_ids: list[int]
    logprobs: list | None  # this delta's logprob entries
    finish_reason: str | None
    stop_reason: str | int | None
    first: bool  # first delta of this choice


class DeltaTracker:
    """Turns cumulative `RequestOutput`s into per-choice deltas for streaming."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cursors: dict[int, ChoiceCursor] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        result = []
        for choice in output.outputs:
            index = prompt_index * self.n + choice.index
            cursor = self.cursors.get(index)
            first = cursor is None
            cursor = cursor or self.cursors.setdefault(index, ChoiceCursor())
            if cursor.finished:
                continue
            text = choice.text[cursor.text:]
            token_ids = list(choice.token_ids[cursor.tokens:])
            logprobs = list(choice.logprobs[cursor.logprobs:]) if choice.logprobs is not None else None
            cursor.text, cursor.tokens = len(choice.text), len(choice.token_ids)
            cursor.logprobs = len(choice.logprobs) if choice.logprobs is not None else 0
            cursor.finished = choice.finish_reason is not None
            self.completion_tokens[index] = len(choice.token_ids)
            if not (text or token_ids or cursor.finished or first):
                continue
            result.append(Delta(index, text, token_ids, logprobs, choice.finish_reason,
                                choice.stop_reason, first))
        return result

    def usage(self) -> UsageInfo:
        return UsageInfo.of(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()),
                            sum(self.cached_tokens.values()))


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merged(streams):
        finals[i] = output
    return [f for f in finals if f is not None]


def sorted_choices(output: RequestOutput) -> list[CompletionOutput]:
    return sorted(output.outputs, key=lambda c: c.index)


async def until_disconnect(request: Request, ctx: ServerContext, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler's `work`; if the client disconnects first, cancel it (its
    `finally` aborts the engine requests, freeing their blocks at once)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        ctx.client_disconnected()
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)
    return task.result()
