"""Graceful drain: a uvicorn `Server` whose first SIGTERM/SIGINT stops new requests (503),
lets requests in flight finish for up to --shutdown-timeout seconds, ends the rest cleanly (a
final SSE error event, or an error body), then exits 0. A second signal exits at once."""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from server.context import ServerContext

logger = logging.getLogger(__name__)

_FLUSH_S = 0.5  # time for cancelled handlers to write their last error frame


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: unlike uvicorn's own handler we do not record the signal, so it is not re-raised
        # after shutdown: a drained server exits 0.
        if self.ctx.draining or self._loop is None:
            logger.warning("Second signal: exiting now")
            self.should_exit = True
            self.force_exit = True
            return
        self.ctx.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def exit_now(self, code: int) -> None:
        """Stop serving (used when the engine fails to load)."""
        self.exit_code = code
        self.should_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine, timeout = self.ctx.engine, self.ctx.settings.shutdown_timeout
        logger.info("Draining: %d request(s) in flight, waiting up to %.0f s", engine.num_in_flight, timeout)
        deadline = time.monotonic() + timeout
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = engine.cancel_all("The server is shutting down; the request was ended before it finished.")
        if ended:
            logger.warning("Drain timeout: ended %d request(s) still in flight", ended)
            await asyncio.sleep(_FLUSH_S)
        self.should_exit = True
