"""AsyncEngine over the fake engine, in-process: ordering, abort on cancel, error paths."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, EngineState, QueueFullError, RequestFailedError
from engine.sampling_params import SamplingParams
from tests.server.fake_engine import FakeEngine


def run_with_engine(body, factory=FakeEngine, **kw):
    async def main():
        engine = AsyncEngine(factory, **kw)
        engine.start()
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_generate_streams_to_the_end_and_reports_stats():
    seen = []

    async def body(engine):
        await engine.wait_ready()
        outs = [o async for o in engine.generate("r1", "a", SamplingParams(max_tokens=5))]
        return outs

    outs = run_with_engine(body, on_stats=seen.append)
    assert outs[-1].finished and outs[-1].outputs[0].text == "bcdef"
    assert [len(o.outputs[0].token_ids) for o in outs] == sorted({len(o.outputs[0].token_ids) for o in outs})
    assert seen, "on_stats was never called"


def test_cancelling_the_iterator_aborts_the_request():
    async def body(engine):
        await engine.wait_ready()
        gen = engine.generate("r1", "SLOW", SamplingParams(max_tokens=100))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if await engine.call(lambda e: not e.requests):
                return engine.num_in_flight
            await asyncio.sleep(0.01)
        raise AssertionError("request still in the engine")

    assert run_with_engine(body) == 0


def test_value_error_from_add_leaves_nothing_behind():
    async def body(engine):
        await engine.wait_ready()
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("r1", "x" * 200, SamplingParams(max_tokens=10))
        return engine.num_in_flight, engine.num_queued

    assert run_with_engine(body) == (0, 0)


def test_failing_request_is_isolated():
    async def body(engine):
        await engine.wait_ready()
        good = await engine.add_request("good", "a", SamplingParams(max_tokens=50))
        bad = await engine.add_request("bad", "FAIL_REQUEST", SamplingParams(max_tokens=50))
        with pytest.raises(RequestFailedError):
            async for _ in bad:
                pass
        outs = [o async for o in good]
        return outs[-1].outputs[0].finish_reason, engine.state

    assert run_with_engine(body) == ("length", EngineState.READY)


def test_dead_loop_fails_everything_and_refuses_new_requests():
    async def body(engine):
        await engine.wait_ready()
        stream = await engine.add_request("r", "KILL_ENGINE", SamplingParams(max_tokens=5))
        with pytest.raises((EngineDeadError, RequestFailedError)):
            async for _ in stream:
                pass
        for _ in range(100):
            if engine.state is EngineState.DEAD:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", "a", SamplingParams(max_tokens=5))
        return engine.state

    assert run_with_engine(body) is EngineState.DEAD


def test_load_failure_reports_dead():
    def broken():
        raise RuntimeError("no weights")

    async def body(engine):
        with pytest.raises(EngineDeadError, match="no weights"):
            await engine.wait_ready()
        return engine.state

    assert run_with_engine(body, factory=broken) is EngineState.DEAD


def test_queue_bound():
    async def body(engine):
        await engine.wait_ready()
        engine.check_accepting(2)
        with pytest.raises(QueueFullError):
            engine.check_accepting(3)

    run_with_engine(body, max_queued_requests=2)


def test_queued_count_returns_to_zero():
    async def body(engine):
        await engine.wait_ready()
        streams = [await engine.add_request(f"r{i}", "a", SamplingParams(max_tokens=3)) for i in range(5)]
        for stream in streams:
            async for _ in stream:
                pass
            engine.release(stream.request_id)
        return engine.num_queued, engine.num_in_flight

    assert run_with_engine(body) == (0, 0)
