"""What completions and chat share: starting one engine request per prompt (streamed requests
get delta outputs, the others one final output), reading their outputs merged, tracking the
streamed choices, and aborting everything when the client goes away (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from engine.core.admission import EngineRequest
from engine.core.outputs import CompletionOutput, OutputKind, RequestOutput
from engine.loop.async_engine import AsyncEngine, RequestFailedError, RequestStream
from server.context import ServerContext
from server.errors import OpenAIError, from_engine_error, from_request_error
from server.protocol import UsageInfo

logger = logging.getLogger(__name__)


async def start_requests(engine: AsyncEngine, base_id: str, requests: list[EngineRequest], stream: bool,
                         prompt_param: str = "prompt") -> list[RequestStream]:
    """Add the admitted requests (server/admission.py) to the engine (request ids
    `{base_id}-{i}`); all or nothing. `stream`: outputs are deltas (else one final output per
    request).

    Raises OpenAIError: 400 for what the engine refuses (a prompt or width its pool can never
    run: engine/loop/request_checks.py), 429/503 for the engine's state."""
    try:
        engine.check_accepting(len(requests))
    except Exception as exc:  # noqa: BLE001
        raise from_engine_error(exc) from None
    streams: list[RequestStream] = []
    kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
    try:
        for i, request in enumerate(requests):
            streams.append(await engine.add_admitted(f"{base_id}-{i}", request, checked=True, output_kind=kind))
    except BaseException as exc:
        release(engine, streams)
        if isinstance(exc, ValueError):
            raise from_request_error(exc, prompt_param) from None
        if isinstance(exc, (OpenAIError, asyncio.CancelledError)):
            raise
        raise from_engine_error(exc) from None
    return streams


@contextlib.contextmanager
def answering(engine: AsyncEngine, streams: list[RequestStream]):
    """Around a route's reading of `streams` into its whole (non-streamed) answer: an OpenAIError
    or a cancellation passes as it is, any other failure becomes this request's engine error
    (`from_engine_error(..., in_flight=True)`), and the streams are released on every path."""
    try:
        yield
    except (asyncio.CancelledError, OpenAIError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request's failure
        raise from_engine_error(exc, in_flight=True) from None
    finally:
        release(engine, streams)


def release(engine: AsyncEngine, streams: list[RequestStream]) -> None:
    """Abort every stream not read to its end, and forget them all."""
    for stream in streams:
        engine.release(stream.request_id)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive; an error in any stream ends it.
    NOTE: one read in flight per stream, so that a slow consumer leaves the rest to each
    stream's own coalescing rather than to a queue here."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    reads = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: reads[t]):
                i = reads.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield i, output
                reads[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in reads:
            task.cancel()


@dataclass
class Delta:
    index: int  # the choice index in the response: prompt index * n + output index
    text: str
    token_ids: list[int]
    logprobs: list | None  # this delta's logprob entries
    finish_reason: str | None
    stop_reason: str | int | None
    first: bool  # first delta of this choice


class StreamTracker:
    """The choices of a streamed response, fed the engine's delta outputs (OutputKind.DELTA):
    which choices have started and finished, and the usage so far. Constant work per delta."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self.cached_tokens: dict[int, int] = {}

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        result = []
        for choice in output.outputs:
            index = prompt_index * self.n + choice.index
            if index in self.finished:
                continue
            first = index not in self.started
            self.started.add(index)
            if choice.finish_reason is not None:
                self.finished.add(index)
            self.completion_tokens += len(choice.token_ids)
            if not (choice.text or choice.token_ids or choice.finish_reason is not None or first):
                continue
            result.append(Delta(index, choice.text, choice.token_ids, choice.logprobs, choice.finish_reason,
                                choice.stop_reason, first))
        return result

    def usage(self) -> UsageInfo:
        return UsageInfo.of(sum(self.prompt_tokens.values()), self.completion_tokens,
                            sum(self.cached_tokens.values()))


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream, in prompt order. Every choice of it has an OpenAI
    finish_reason ("stop" or "length"); one without (a request the engine ended aborted, which
    always comes with an error) is an internal failure of that request."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merged(streams):
        finals[i] = output
    for final in finals:
        if final is not None and any(c.finish_reason is None for c in final.outputs):
            logger.error("request %s ended without a finish reason: %s", final.request_id, final.outputs)
            raise RequestFailedError("Internal error while generating this request; the server log has the details.")
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
