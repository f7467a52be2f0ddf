"""`AsyncEngine`: the asyncio face of the (not thread-safe) `LLMEngine`.

One background thread owns the `LLMEngine`: it loads it, then loops

    run queued commands (add / abort / block map)  ->  engine.step()  ->  publish outputs

so a forward pass never blocks the asyncio event loop. Everything else talks to that thread
through a command queue; results come back to the event loop with `call_soon_threadsafe`, once
per step for all requests together.

Threads and ownership:
- engine thread: the `LLMEngine`, `EngineThread.live` (ids the engine holds), `on_stats` calls.
- event loop thread: `_streams` (one `RequestStream` per request still being read), counters.

Failures:
- `add_request` raises the engine's `ValueError` (bad input: the server answers 400).
- A step that raises an exception naming a request (`exc.request_id`) fails that request only;
  one that names none fails every request in flight (we cannot tell which one was at fault) and
  the loop carries on. If the loop itself breaks (or steps keep failing), the engine is dead:
  every stream fails with `EngineDeadError` and new requests are refused with it.

The engine thread is an `EngineThread` (engine/loop/engine_thread.py) that this object holds;
`RequestStream` and these errors are defined in engine/loop/request_stream.py and importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.core.admission import EngineRequest
from engine.core.outputs import OutputKind, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.loop.engine_core import EngineCore
from engine.loop.engine_thread import INTERNAL_ERROR, EngineState, EngineThread
from engine.loop.metrics import EngineStats
from engine.loop.request_stream import (
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestCancelledError,
    RequestFailedError,
    RequestInvalidError,
    RequestStream,
)
from engine.loop.watchdog import StepWatchdog

logger = logging.getLogger(__name__)

T = TypeVar("T")



class AsyncEngine:
    """Runs an `LLMEngine` on a background thread; see the module docstring."""

    def __init__(
        self,
        engine_factory: Callable[[], EngineCore],
        *,
        on_ready: Callable[[EngineCore], None] | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
        max_queued_requests: int | None = None,
        stall_timeout: float | None = 120.0,
        freeze_gc: bool = False,
    ) -> None:
        """`engine_factory` builds the `LLMEngine` (on the engine thread, it may take seconds);
        `on_ready(engine)` runs on the engine thread once it is built (it may set `on_stats`);
        `on_stats(stats)` runs on the engine thread after every step. `stall_timeout`: seconds
        of pending work without a finished step after which the engine counts as stalled
        (`check_stall`); None never."""
        self.max_queued_requests = max_queued_requests
        # The engine thread and what it owns (the engine, its state): see the properties below.
        self._engine_thread = EngineThread(engine_factory, on_ready=on_ready, on_stats=on_stats, freeze_gc=freeze_gc,
                                           stall_timeout=stall_timeout, to_loop=self._to_loop,
                                           set_ready=self._set_ready, fail=self._fail, dispatch=self._dispatch)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_future: asyncio.Future[None] | None = None
        # Event-loop side.
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds = 0  # add commands sent, not yet answered
        self._unstarted: set[str] = set()  # added, no output yet (waiting in the engine)

    # ------------------------------------------------------- the engine thread's state (read)
    @property
    def engine(self) -> EngineCore | None:
        """Set once loaded; only the engine thread may call into it."""
        return self._engine_thread.engine

    @property
    def state(self) -> EngineState:
        return self._engine_thread.state

    @property
    def dead_reason(self) -> str | None:
        """What killed the engine, for the log (may hold exception text)."""
        return self._engine_thread.dead_reason

    @property
    def public_dead_reason(self) -> str | None:
        """What clients and /health are told of it."""
        return self._engine_thread.public_dead_reason

    @property
    def last_stats(self) -> EngineStats | None:
        return self._engine_thread.last_stats

    @property
    def load_seconds(self) -> float | None:
        return self._engine_thread.load_seconds

    @property
    def watchdog(self) -> StepWatchdog:
        """Fed by the engine thread, read on the event loop (/health, /metrics)."""
        return self._engine_thread.watchdog

    @property
    def freeze_gc(self) -> bool:
        return self._engine_thread.freeze_gc

    @property
    def on_ready(self) -> Callable[[EngineCore], None] | None:
        return self._engine_thread.on_ready

    @on_ready.setter
    def on_ready(self, fn: Callable[[EngineCore], None] | None) -> None:
        self._engine_thread.on_ready = fn

    @property
    def on_stats(self) -> Callable[[EngineStats], None] | None:
        return self._engine_thread.on_stats

    @on_stats.setter
    def on_stats(self, fn: Callable[[EngineStats], None] | None) -> None:
        self._engine_thread.on_stats = fn

    # ----------------------------------------------------------------- lifecycle (event loop)
    def start(self) -> None:
        """Start loading the engine in the background; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready_future = self._loop.create_future()
        self._engine_thread.start()
        self.watchdog.start(self._loop)

    async def wait_ready(self) -> None:
        """Return once loaded; raise `EngineDeadError` if loading failed."""
        assert self._ready_future is not None, "start() first"
        await asyncio.shield(self._ready_future)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread (requests still in flight are failed). Blocks up to `timeout`."""
        self._engine_thread.stop(timeout)
        for stream in list(self._streams.values()):
            stream.put(RequestCancelledError("The server is shutting down."))
        self._streams.clear()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def num_in_flight(self) -> int:
        """Requests whose outputs someone is still reading."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests sent to the engine that have not produced an output yet (waiting)."""
        return self._pending_adds + len(self._unstarted)

    # ------------------------------------------------------------------ requests (event loop)
    def check_accepting(self, num_requests: int = 1) -> None:
        """Raise unless `num_requests` more requests may be added now (no engine access): 429
        (`QueueFullError`) once adding them would take a non-empty waiting queue past the bound.
        `check_accepting(0)` checks only the engine's state (ready, not loading / dead / stopped)."""
        self._check_state()
        # NOTE: a request is never refused by an empty queue, even one with more prompts than
        # the bound: otherwise it could never be served, and Retry-After would loop forever.
        queued = self.num_queued
        bounded = self.max_queued_requests is not None and num_requests > 0
        if bounded and queued and queued + num_requests > self.max_queued_requests:
            raise QueueFullError(
                f"The server is overloaded: {self.num_queued} requests are already waiting "
                f"(--max-queued-requests {self.max_queued_requests}). Retry shortly."
            )

    def _check_state(self) -> None:
        """Raise unless the engine is ready (loading, dead or stopped)."""
        if self.state is EngineState.DEAD:
            raise EngineDeadError(self.public_dead_reason or "The engine is not running.")
        if self.state is EngineState.STOPPED:
            raise EngineDeadError("The engine has been shut down.")
        if self.state is EngineState.LOADING:
            raise EngineNotReadyError("The model is still loading; try again shortly.")

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                          checked: bool = False, output_kind: OutputKind = OutputKind.CUMULATIVE,
                          prompt_text: str | None = None, grammar: Any = None) -> RequestStream:
        """Add a request (token ids: the caller tokenized it), admitted on the engine thread
        (`EngineCore.add_request`), and return its output stream once the engine has accepted
        it. `prompt_text`, `grammar`, `output_kind`: as `EngineCore.add_request` takes them.

        Raises the engine's `ValueError` for bad input (nothing is left behind), or the
        errors of `check_accepting`. The caller must read the stream to its end or `abort()`.
        `checked`: the caller has already called `check_accepting` for the group of requests
        this one belongs to, so the queue bound is not applied again to each (a multi-prompt
        request is accepted or refused whole); the engine's state still is checked.
        """

        def add(arrival: float) -> None:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival,
                                    output_kind=output_kind, prompt_text=prompt_text, grammar=grammar)

        return await self._add(request_id, add, checked)

    async def add_admitted(self, request_id: str, request: EngineRequest, *, checked: bool = False,
                           output_kind: OutputKind = OutputKind.CUMULATIVE) -> RequestStream:
        """As `add_request`, for a request the caller admitted already (engine/core/admission.py,
        against the engine's `admission_limits`, off the engine thread): the engine thread only
        checks what needs its pool (`EngineCore.add_admitted`)."""

        def add(arrival: float) -> None:
            self.engine.add_admitted(request_id, request, arrival_time=arrival, output_kind=output_kind)

        return await self._add(request_id, add, checked)

    async def _add(self, request_id: str, add_to_engine: Callable[[float], None], checked: bool) -> RequestStream:
        if checked:
            self._check_state()
        else:
            self.check_accepting()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._pending_adds += 1
        arrival = time.monotonic()

        def add() -> None:
            self._engine_thread.add(request_id, lambda: add_to_engine(arrival))

        try:
            await asyncio.wrap_future(self._engine_thread.submit(add, want_result=True))
        except asyncio.CancelledError:
            # NOTE: the add may still run after we stop waiting; commands run in order, so this
            # abort lands after it and nothing leaks.
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._pending_adds -= 1
        # NOTE: the first output may have been dispatched before this coroutine resumed.
        if not stream.started and not stream.finished:
            self._unstarted.add(request_id)
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; closing or cancelling the iterator aborts it."""
        stream = await self.add_request(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)
            self._forget(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent, returns at once); its stream ends with nothing more."""
        stream = self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)
        if stream is not None:
            stream.finished = True
        if self.state is EngineState.READY:
            self._engine_thread.submit(lambda: self._engine_thread.abort(request_id))

    def release(self, request_id: str) -> None:
        """Forget a stream the caller has read to its end (or abort it if it had not ended)."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self.abort(request_id)
        self._forget(request_id)

    def cancel_all(self, message: str) -> int:
        """Fail every request in flight with `RequestCancelledError` and abort it in the engine."""
        ids = list(self._streams)
        for request_id in ids:
            stream = self._streams[request_id]
            stream.put(RequestCancelledError(message))
            self.abort(request_id)
        return len(ids)

    async def block_map(self) -> dict:
        """The engine's block map (`EngineCore.block_map`), built on the engine thread between
        two steps; EngineDeadError / EngineNotReadyError when it cannot run."""
        return await self._call(lambda: self.engine.block_map())

    async def request_blocks(self, request_id: str) -> dict | None:
        """One request's block tables (`EngineCore.request_blocks`), as `block_map` runs."""
        return await self._call(lambda: self.engine.request_blocks(request_id))

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the engine thread between two steps and return its result."""
        if self.state is not EngineState.READY:
            self.check_accepting(0)
        return await asyncio.wrap_future(self._engine_thread.submit(fn, want_result=True))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)

    # --------------------------------------------------------------------- dispatch (event loop)
    def _dispatch(self, outputs: list[RequestOutput], started: list[str] = ()) -> None:
        for request_id in started:
            self._unstarted.discard(request_id)
        for output in outputs:
            self._unstarted.discard(output.request_id)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            error = getattr(output, "error", None)  # the engine failed this request alone
            if error is not None and output.invalid_request:
                stream.put(RequestInvalidError(error))
            elif error is not None:  # NOTE: the engine logged the exception; clients get no internals
                stream.put(RequestFailedError(INTERNAL_ERROR))
                if not output.finished:
                    self.abort(output.request_id)
            else:
                stream.put(output)

    def _fail(self, request_ids: list[str] | None, exc: BaseException) -> None:
        """Fail the given requests (all in flight when None)."""
        ids = list(self._streams) if request_ids is None else request_ids
        for request_id in ids:
            self._unstarted.discard(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(exc)

    def _set_ready(self, error: BaseException | None) -> None:
        future = self._ready_future
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            future.exception()  # NOTE: mark retrieved: nobody may be waiting on it

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the process is exiting
            pass
