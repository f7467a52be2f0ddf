"""Tensor-parallel tests run the driver (rank 0) in the test process and its workers as child
processes (gloo on CPU). Every test leaves no process group and no worker behind, and no test
may hang: a collective gives up after PAGED_SERVE_TP_TIMEOUT seconds (30 here)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = "30"


@pytest.fixture(autouse=True)
def tp_env(monkeypatch):
    monkeypatch.setenv("PAGED_SERVE_TP_TIMEOUT", TIMEOUT_S)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the workers: 2 shared cores
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PAGED_SERVE_TP_LOCAL_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized(), "a test left the process group initialised"
    assert not [p for p in mp.active_children() if p.name.startswith("tp-worker")], "a worker was left running"


@contextlib.contextmanager
def tp_llm(**engine_args):
    """An `LLM` whose executor is shut down on the way out, whatever happened."""
    from engine.loop.llm import LLM

    llm = LLM(**engine_args)
    try:
        yield llm
    finally:
        llm.engine.executor.shutdown()


def top2_of(output) -> list[tuple[tuple[float, int], tuple[float, int]]]:
    """Per generated position, the top-2 (logprob, token id) of a run with logprobs=2."""
    out = []
    for entry in output.logprobs:
        ranked = sorted(((lp.rank, lp.logprob, tid) for tid, lp in entry.items()))
        (_, lp1, id1), (_, lp2, id2) = ranked[0], ranked[1]
        out.append(((lp1, id1), (lp2, id2)))
    return out


def run_until_failure(engine, limit_s: float) -> tuple[Exception, float]:
    """Step `engine` until a step raises: (the exception, seconds it took)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e, time.monotonic() - t0
    raise AssertionError(f"the engine kept running {limit_s} s after its worker was stopped")


def start_long_requests(engine, count: int = 3) -> None:
    """Add `count` requests that run long, and start them."""
    from engine.core.sampling_params import SamplingParams

    for i in range(count):
        engine.add_request(f"r{i}", [5 + i] * 20, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()


def check_a_stopped_worker_fails_the_step(monkeypatch, **engine_args) -> None:
    """SIGSTOP the first worker of an engine running long requests: the next steps give up
    after PAGED_SERVE_TP_TIMEOUT (3 s here) with a WorkerDiedError that names it, well within 15 s."""
    import os
    import signal

    from engine.worker.executor import WorkerDiedError

    monkeypatch.setenv("PAGED_SERVE_TP_TIMEOUT", "3")
    with tp_llm(**engine_args) as llm:
        engine = llm.engine
        start_long_requests(engine)
        os.kill(engine.executor._procs[1].pid, signal.SIGSTOP)
        err, took = run_until_failure(engine, 30)
        assert isinstance(err, WorkerDiedError) and "PAGED_SERVE_TP_TIMEOUT" in str(err), err
        assert took < 15
