"""`RequestStream`: one request's outputs on their way from the engine thread to the one
consumer reading them on the event loop, and the errors that `AsyncEngine` raises to callers
(at `add_request`, or as a stream's last item).

Each error names the HTTP answer the server gives for it (server/errors.py maps them).
"""

from __future__ import annotations

import asyncio

from engine.outputs import RequestOutput


class EngineNotReadyError(RuntimeError):
    """The model is still loading (server: 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop died or failed to load (server: 503 for new requests, 500 in flight)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests (server: 429 with Retry-After)."""


class RequestFailedError(RuntimeError):
    """An internal failure while running this request only (server: 500)."""


class RequestInvalidError(RuntimeError):
    """This request failed inside the engine by its own fault, e.g. a structured-output
    constraint the vocabulary cannot meet (server: 400)."""


class RequestCancelledError(RuntimeError):
    """The server ended the request itself, e.g. at the end of a graceful drain (server: 503)."""


class RequestStream:
    """The outputs of one request, in order, read by one consumer on the event loop.

    Outputs are cumulative, so a consumer that falls behind skips to the latest one: `__anext__`
    returns the newest output queued (never skipping the final one or an error).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.started = False  # something has been put (an output or an error)
        self.finished = False  # no more items will be put (finished output, error or abort)
        self._done = False  # the consumer has seen the end

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self.started = True
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item
