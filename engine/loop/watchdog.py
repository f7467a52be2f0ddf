"""`StepWatchdog`: tells whether the engine loop is still making progress.

The engine thread reports what it does (`busy` when it leaves its idle wait, `progress` when a
step that ran something ends, `idle` when it has nothing left to do); the event loop asks
`seconds_without_progress` (/metrics) and `check` (/health, and every second on its own, so a
stall is counted and logged when it starts even if nobody asks). A stall is work pending, a
request or a command, with no finished step for longer than the timeout: a hung forward pass,
a command that never returns, or a scheduler that can run nothing.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PERIOD_S = 1.0


class StepWatchdog:
    def __init__(self, timeout: float | None, thread: Callable[[], threading.Thread | None],
                 active: Callable[[], bool]) -> None:
        """`timeout`: seconds without progress that make a stall (None: never); `thread()`: the
        engine thread, whose stack a stall logs; `active()`: whether the engine is serving (a
        loading or dead engine is not stalled; /health says what it is)."""
        self.timeout = timeout
        self._thread = thread
        self._active = active
        # Written by the engine thread only (a float store is atomic in CPython).
        self._busy_since: float | None = None
        self._last_progress = 0.0
        # Event loop only.
        self.num_stalls = 0  # stalls seen, each counted once when it starts
        self._reported = False
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ engine thread
    def busy(self) -> None:
        """The loop is awake with something to do (commands, maybe requests)."""
        if self._busy_since is None:
            self._busy_since = time.monotonic()

    def progress(self) -> None:
        """A step that ran something has finished."""
        self._last_progress = time.monotonic()

    def idle(self) -> None:
        """Nothing is pending: the loop goes to sleep."""
        self._busy_since = None

    # ------------------------------------------------------------------ event loop
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timeout is not None and self._task is None:
            self._task = loop.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def seconds_without_progress(self) -> float:
        """How long work has been pending without a finished step; 0 while idle or inactive."""
        busy = self._busy_since
        if busy is None or not self._active():
            return 0.0
        return max(0.0, time.monotonic() - max(busy, self._last_progress))

    def check(self) -> str | None:
        """None while the engine keeps stepping; otherwise why it counts as stalled. A new
        stall is counted and the engine thread's stack is logged, once."""
        age = self.seconds_without_progress()
        if self.timeout is None or age <= self.timeout:
            self._reported = False
            return None
        if not self._reported:
            self._reported = True
            self.num_stalls += 1
            logger.error("engine stalled: work pending for %.0f s without a finished step "
                         "(--engine-stall-timeout %g s); the engine thread is at:\n%s", age, self.timeout,
                         self._stack())
        return (f"The engine has had work pending for {age:.0f} s without finishing a step "
                f"(--engine-stall-timeout {self.timeout:g} s).")

    def _stack(self) -> str:
        thread = self._thread()
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
        return "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(not running)"

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_PERIOD_S)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must not die
                logger.exception("watchdog check failed")
