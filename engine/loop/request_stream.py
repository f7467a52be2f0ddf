"""`RequestStream`: one request's outputs on their way from the engine thread to the one
consumer reading them on the event loop, and the errors that `AsyncEngine` raises to callers
(at `add_request`, or as a stream's last item).

Each error names the HTTP answer the server gives for it (server/errors.py maps them).
"""

from __future__ import annotations

import asyncio

from engine.core.outputs import RequestOutput


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


class _Pending:
    """An output still in a stream's queue, into which later outputs are folded while the
    reader is behind: a cumulative output is replaced by the newer one; a delta is extended
    (texts kept as pieces and joined once, when the reader takes it), so a slow reader costs
    memory and time linear in what it has not read yet."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.texts: dict[int, list[str]] = {c.index: [c.text] for c in output.outputs} if output.delta else {}

    def fold(self, later: RequestOutput) -> None:
        if not later.delta:
            self.output = later
            return
        out = self.output
        by_index = {c.index: c for c in out.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                out.outputs.append(c)
                by_index[c.index] = c
                self.texts[c.index] = [c.text]
                continue
            self.texts[c.index].append(c.text)
            mine.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(c.logprobs)
            mine.cumulative_logprob, mine.finish_reason, mine.stop_reason = (
                c.cumulative_logprob, c.finish_reason, c.stop_reason)
        out.finished, out.metrics, out.error, out.invalid_request = (
            later.finished, later.metrics, later.error, later.invalid_request)
        out.prompt_logprobs, out.num_cached_tokens = later.prompt_logprobs, later.num_cached_tokens

    def settle(self) -> RequestOutput:
        for c in self.output.outputs:
            parts = self.texts.get(c.index)
            if parts is not None and len(parts) > 1:
                c.text = "".join(parts)
        return self.output


class RequestStream:
    """The outputs of one request, in order, read by one consumer on the event loop.

    A consumer that falls behind gets the outputs it missed coalesced into one (`_Pending`):
    never the final output or an error merged away, and never a queue of copies.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[_Pending | BaseException] = asyncio.Queue()
        self._last: _Pending | None = None  # the newest item in the queue, if it is an unread output
        self.started = False  # something has been put (an output or an error)
        self.finished = False  # no more items will be put (finished output, error or abort)
        self._done = False  # the consumer has seen the end

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self.started = True
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        if isinstance(item, BaseException):
            self._last = None
            self._queue.put_nowait(item)
        elif self._last is not None:
            self._last.fold(item)
        else:
            self._last = _Pending(item)
            self._queue.put_nowait(self._last)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is self._last:
            self._last = None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        output = item.settle()
        if output.finished:
            self._done = True
        return output
