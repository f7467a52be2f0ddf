"""`EngineThread`: the thread that owns the engine behind `AsyncEngine` (engine/loop/async_engine.py).
It loads the engine, then loops

    run queued commands (add / abort / block map)  ->  engine.step()  ->  publish outputs

until stopped; a step that names a request in its exception fails that request only, one that
names none fails every request in flight, and repeated or fatal failures kill the loop (the
engine is then dead: every stream fails with EngineDeadError).

NOTE: a separate object that `AsyncEngine` holds (it was a mixin of it, one class over two
files that imported each other): the event loop reaches this thread only through `submit` and
`stop`, and it reaches the event loop only through the callbacks it is given.
"""

from __future__ import annotations

import concurrent.futures
import enum
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.core.outputs import RequestOutput
from engine.loop.request_stream import EngineDeadError, RequestFailedError
from engine.loop.step_calibration import calibrate_step_cost
from engine.loop.watchdog import StepWatchdog
from engine.worker.models.gguf_file import GGUFError
from engine.worker.models.registry import UnsupportedModelError

logger = logging.getLogger(__name__)

_MAX_CONSECUTIVE_STEP_FAILURES = 3
_IDLE_WAIT_S = 1.0  # the loop also wakes on every command; this only bounds a missed wake-up
_EMPTY_STEP_WAIT_S = (0.001, 0.25)  # back-off after steps that ran nothing: first wait, longest wait
INTERNAL_ERROR = "Internal error while generating this request; the server log has the details."


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"  # failed to load, or the loop broke: nothing will be served again
    STOPPED = "stopped"  # shut down on purpose


class EngineThread:
    """The engine thread and the state it owns. Shared with the event loop, as single
    references read or written whole: `state`, `dead_reason`, `public_dead_reason`, `engine`
    (only this thread may call into it), `last_stats`, `load_seconds`, `on_stats`. `live` (ids
    the engine holds) is this thread's alone.

    `to_loop(fn, *args)` runs `fn(*args)` on the event loop; through it this thread calls
    `set_ready(error or None)` once loaded, `fail(request_ids or None for all, exc)` and
    `dispatch(outputs, started)` after each step."""

    def __init__(self, factory: Callable[[], Any], *, on_ready: Callable[[Any], None] | None,
                 on_stats: Callable[[Any], None] | None, freeze_gc: bool, stall_timeout: float | None,
                 to_loop: Callable[..., None], set_ready: Callable[[BaseException | None], None],
                 fail: Callable[[list[str] | None, BaseException], None],
                 dispatch: Callable[[list[RequestOutput], list[str]], None]) -> None:
        self._factory = factory
        self.on_ready = on_ready
        self.on_stats = on_stats
        self.freeze_gc = freeze_gc  # once loaded, keep what exists out of the cyclic GC (a server's engine)
        self.state = EngineState.LOADING
        self.dead_reason: str | None = None  # what killed it, for the log (may hold exception text)
        self.public_dead_reason: str | None = None  # what clients and /health are told
        self.engine = None  # set once loaded; only the engine thread may call into it
        self.last_stats = None
        self.load_seconds: float | None = None
        self._to_loop, self._set_ready, self._fail, self._dispatch = to_loop, set_ready, fail, dispatch
        # (command, future for its result or None); run in order on the engine thread.
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = (
            queue.SimpleQueue())
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.live: set[str] = set()
        self._stats_stale = False
        # Fed by the engine thread, read on the event loop (/health, /metrics).
        self.watchdog = StepWatchdog(stall_timeout, lambda: self.thread, lambda: self.state is EngineState.READY)

    # -------------------------------------------------------------- called from the event loop
    def start(self) -> None:
        self.thread = threading.Thread(target=self._thread_main, name="engine-loop", daemon=True)
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the loop and join the thread (up to `timeout`); then fail what is still queued."""
        if self.state in (EngineState.LOADING, EngineState.READY):
            self.state = EngineState.STOPPED
        self.watchdog.stop()
        self._stop.set()
        self._wakeup.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self.fail_pending_commands()

    def submit(self, command: Callable[[], Any], want_result: bool = False) -> concurrent.futures.Future | None:
        """Queue `command` for the engine thread; with `want_result`, a future for its result."""
        future = concurrent.futures.Future() if want_result else None
        self._commands.put((command, future))
        self._wakeup.set()
        if self.state is EngineState.DEAD:  # NOTE: the loop may have died before taking it
            self.fail_pending_commands()
        return future

    def fail_pending_commands(self) -> None:
        """After the loop died: answer every queued command's future with EngineDeadError,
        so that no caller waits forever (callable from any thread)."""
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                future.set_exception(EngineDeadError(self.public_dead_reason or "The engine is not running."))

    # ---------------------------------------------------------------- on the engine thread
    def add(self, request_id: str, add_to_engine: Callable[[], None]) -> None:
        """A command: `add_to_engine()` (the engine's add_request or add_admitted for this id),
        then hold the id."""
        add_to_engine()
        self.live.add(request_id)

    def abort(self, request_id: str) -> None:
        """A command: abort the request in the engine if it holds it."""
        if request_id in self.live:
            self.live.discard(request_id)
            self.engine.abort_request(request_id)
            self._stats_stale = True

    def _thread_main(self) -> None:
        start = time.monotonic()
        try:
            self.engine = self._factory()
            # NOTE: before the first request, so that the step-time cap holds from the first burst
            calibrate_step_cost(self.engine)
            if self.on_ready is not None:
                self.on_ready(self.engine)
            self.last_stats = self.engine.last_stats
        except BaseException as exc:  # noqa: BLE001 - reported, the server stays up to say so
            # a bad model file or a config we cannot serve: its one line (file, field, reason) says it all
            one_line = isinstance(exc, (GGUFError, UnsupportedModelError))
            if one_line:
                logger.error("The engine failed to load: %s", exc)
            else:
                logger.exception("The engine failed to load")
            self._die(f"The engine failed to load: {exc if one_line else repr(exc)}",
                      "The engine failed to load; the server log has the details.")
            self._to_loop(self._set_ready, EngineDeadError(self.dead_reason))
            return
        self.load_seconds = time.monotonic() - start
        if self.freeze_gc:
            # NOTE: the engine (the model, a Block per KV block, the tokenizer) lives as long as
            # the process: out of the cyclic GC's sight, its collections (which every step's
            # garbage triggers) no longer walk it. vLLM does the same.
            gc.collect()
            gc.freeze()
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        logger.info("Engine ready in %.1f s", self.load_seconds)
        self._to_loop(self._set_ready, None)
        try:
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001
            logger.exception("The engine loop died")
            public = getattr(exc, "public_reason", None)  # a dead tensor-parallel worker names its rank
            self._die(f"The engine loop died: {exc!r}",
                      f"The engine loop died: {public}" if public else
                      "The engine loop died; the server log has the details.")
        finally:
            if self.engine is not None:
                try:
                    self.engine.shutdown()  # tensor-parallel workers get a clean stop message
                except Exception:  # noqa: BLE001 - already shutting down
                    logger.exception("engine shutdown failed")

    def _die(self, reason: str, public: str) -> None:
        self.dead_reason, self.public_dead_reason = reason, public
        self.state = EngineState.DEAD
        self.fail_pending_commands()
        self._to_loop(self._fail, None, EngineDeadError(public))

    def _loop_forever(self) -> None:
        failures = empty_steps = 0
        while not self._stop.is_set():
            self._wakeup.clear()
            self.watchdog.busy()
            self._run_commands()
            if self._stop.is_set():
                break
            if not self.engine.has_unfinished_requests():
                if self._stats_stale:
                    self._refresh_idle_stats()
                self.engine.check_health()  # a dead tensor-parallel worker ends the loop even while idle
                self.watchdog.idle()
                self._wakeup.wait(_IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - isolated below
                failures += 1
                # NOTE: an error marked fatal (a dead tensor-parallel worker) cannot be retried.
                if getattr(exc, "fatal", False) or failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                    raise
                self._isolate_step_failure(exc)
                continue
            failures = 0
            self._publish(outputs)
            if self.engine.last_step_empty:
                # NOTE: work is pending but nothing could run (not expected: the scheduler always
                # runs the oldest request). Back off instead of spinning; the watchdog sees no
                # progress and /health says so.
                empty_steps += 1
                first, longest = _EMPTY_STEP_WAIT_S
                self._wakeup.wait(min(first * 2 ** min(empty_steps, 16), longest))
            else:
                empty_steps = 0
                self.watchdog.progress()

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is None:
                command()  # NOTE: an exception here (an abort failing) kills the loop: as it should
                continue
            try:
                future.set_result(command())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self.live.discard(output.request_id)
        # NOTE: a request that outputs only when done (FINAL_ONLY) leaves the queue when first scheduled.
        started = list(self.engine.newly_scheduled)
        if outputs or started:
            self._to_loop(self._dispatch, outputs, started)
        self._observe()

    def _observe(self) -> None:
        self._stats_stale = False
        stats = self.engine.last_stats
        self.last_stats = stats
        if stats is not None and self.on_stats is not None:
            try:
                self.on_stats(stats)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("on_stats observer failed")

    def _refresh_idle_stats(self) -> None:
        """After aborts with nothing left to run, take one (empty) step so that the stats show
        the freed blocks; the engine's step() on an empty queue is expected to be a no-op."""
        try:
            self.engine.step()
        except Exception:  # noqa: BLE001
            logger.exception("idle step to refresh stats failed")
        self._observe()

    def _isolate_step_failure(self, exc: Exception) -> None:
        culprit = getattr(exc, "request_id", None)
        ids = [culprit] if culprit in self.live else sorted(self.live)
        logger.error("engine step failed (%r); failing %d request(s): %s", exc, len(ids), ids[:8],
                     exc_info=exc)
        for request_id in ids:
            self.abort(request_id)
        self._to_loop(self._fail, ids, RequestFailedError(INTERNAL_ERROR))
