"""The engine watchdog: a stalled engine (work pending, no step finishing) is reported by
/health (503, with the reason), by /metrics (seconds without progress, a stall counter) and in
the log (the engine thread's stack, once); an engine that can run nothing does not spin."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine.core.sampling_params import SamplingParams
from tests.server.conftest import FAULTY, start_server
from tests.server.faulty_engine import HANG, HANG_S, STUCK
from tests.server.support import post
from tests.server.test_async_engine import _tokenizer, add, engine_factory, llm, run_with_engine  # noqa: F401

MODEL = "SmolLM2-135M-Instruct"


def test_an_engine_that_can_run_nothing_backs_off_and_is_reported_stalled(engine_factory, llm):  # noqa: F811
    async def body(engine):
        await engine.wait_ready()
        assert engine.watchdog.check() is None
        stream = await add(engine, "stuck", f"{STUCK} here", SamplingParams(max_tokens=4))
        steps_before = llm.num_steps
        await asyncio.sleep(1.5)
        steps = llm.num_steps - steps_before
        reasons = [engine.watchdog.check() for _ in range(3)]
        stalls = engine.watchdog.num_stalls
        engine.abort(stream.request_id)
        for _ in range(100):  # idle again: the stall is over
            if engine.watchdog.check() is None:
                break
            await asyncio.sleep(0.05)
        return steps, reasons, stalls, engine.watchdog.check(), engine.watchdog.num_stalls

    steps, reasons, stalls, after, stalls_after = run_with_engine(body, engine_factory, stall_timeout=1.0)
    # NOTE: with the back-off a few dozen empty steps at most; a spinning loop makes thousands.
    assert steps < 50, steps
    assert all(r is not None and "without finishing a step" in r for r in reasons), reasons
    assert stalls == 1  # counted once, however often it is asked
    assert after is None and stalls_after == 1


@pytest.fixture(scope="module")
def stall_server():
    server = start_server("--engine-factory", FAULTY, "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                          "--engine-stall-timeout", "1", "--log-level", "warning", "--disable-uvicorn-access-log")
    yield server
    server.stop()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_health_is_503_while_the_engine_hangs_and_200_after(stall_server):
    url = stall_server.url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert metric(url, "paged_serve:engine_stalls_total") == 0

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            hung = asyncio.create_task(client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"{HANG} now", "max_tokens": 3}))
            seen, stalled_metric = [], None
            start = time.monotonic()
            while not hung.done() and time.monotonic() - start < HANG_S + 30:
                health = await client.get("/health")
                seen.append((health.status_code, health.json()))
                if health.status_code == 503 and stalled_metric is None:
                    stalled_metric = metric(url, "paged_serve:engine_seconds_without_progress")
                await asyncio.sleep(0.2)
            return await hung, seen, stalled_metric

    response, seen, stalled_metric = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    stalled = [body for status, body in seen if status == 503]
    assert stalled and all(b["status"] == "stalled" and "--engine-stall-timeout 1" in b["reason"] for b in stalled)
    assert stalled_metric is not None and stalled_metric > 1.0
    assert httpx.get(url + "/health").status_code == 200
    assert metric(url, "paged_serve:engine_stalls_total") == 1
    assert metric(url, "paged_serve:engine_seconds_without_progress") < 1.0
    log = stall_server.log()
    assert log.count("engine stalled") == 1 and "faulty_engine.py" in log  # the stack, once
    assert post(stall_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
