"""The real `LLMEngine` (default model, the CLI's `EngineArgs`) with faults on demand, for the
server tests: `python -m server --engine-factory tests.server.faulty_engine:build ...`.

Every request computes real tokens with the real engine. Only a request whose prompt text
contains a marker (chat prompts too: the markers survive the chat template) triggers a fault:
- "FAULT:FAIL": once it has its first token, `step()` raises `RequestFault` naming it (before the
  real step runs, so the engine state is intact): the async engine must fail it alone.
- "FAULT:ERROR": its sampled token fails to append inside the real step, so the engine's own
  per-request isolation marks its output with `error` (and ends it aborted).
- "FAULT:KILL": `step()` raises and the engine stays broken (`has_unfinished_requests()` raises
  too): the loop dies and the server must say so (/health 503, new requests 503).
- "FAULT:SLOW": every step sleeps `SLOW_STEP_S` more while it is in the engine (drain and queue
  tests need requests that stay in flight for a while).
- "FAULT:HANG": the first step it is in sleeps `HANG_S` (a forward pass that hangs for a while):
  the watchdog must see the stall, then the recovery.
- "FAULT:STUCK": while it is in the engine, steps run nothing (as a scheduler that can schedule
  nothing would): the loop must not spin, and the watchdog must see the stall.
Token-id prompts carry no text and so never trigger a fault.
"""

from __future__ import annotations

import time

from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine

FAIL = "FAULT:FAIL"
ERROR = "FAULT:ERROR"
KILL = "FAULT:KILL"
SLOW = "FAULT:SLOW"
HANG = "FAULT:HANG"
STUCK = "FAULT:STUCK"
SLOW_STEP_S = 0.1
HANG_S = 3.0


class RequestFault(RuntimeError):
    """An injected failure that names its request (as `AsyncEngine` expects: `exc.request_id`)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"injected failure in request {request_id}")
        self.request_id = request_id


class FaultyEngine(LLMEngine):
    killed = False  # set by a FAULT:KILL request; the engine never works again
    num_steps = 0  # step() calls, stuck ones included

    def _marked(self, marker: str) -> list:
        return [g for g in self.requests.values() if g.prompt and marker in g.prompt]

    def has_unfinished_requests(self) -> bool:
        if self.killed:
            raise RuntimeError("injected engine death (the engine is broken)")
        return super().has_unfinished_requests()

    def step(self):
        if self._marked(KILL):
            self.killed = True
            raise RuntimeError("injected engine death")
        for group in self._marked(FAIL):
            if any(seq.output_token_ids for seq in group.seqs):
                raise RequestFault(group.request_id)
        if self._marked(SLOW):
            time.sleep(SLOW_STEP_S)
        self.num_steps += 1
        if self._marked(STUCK):
            self.last_step_empty, self.newly_scheduled = True, []
            return []
        for group in self._marked(HANG):
            if not getattr(group, "hung", False):
                group.hung = True
                time.sleep(HANG_S)
        return super().step()

    def _append(self, seq, group, sample) -> None:
        if group.prompt and ERROR in group.prompt:
            raise ValueError("injected sampling failure")
        super()._append(seq, group, sample)


def build(engine_args: EngineArgs) -> FaultyEngine:
    return FaultyEngine.from_engine_args(engine_args)


def build_slow(engine_args: EngineArgs) -> FaultyEngine:
    """Load 3 s later than usual, so that tests can watch the loading state."""
    time.sleep(3)
    return build(engine_args)


def build_failing(engine_args: EngineArgs) -> FaultyEngine:
    raise RuntimeError("injected load failure")
