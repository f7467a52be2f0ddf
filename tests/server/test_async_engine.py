"""AsyncEngine in-process over the real engine (default model, loaded once for the module,
with `tests.server.faulty_engine`'s markers for the error paths): ordering, abort on cancel,
error isolation, a dead loop, the queue bound."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.async_engine import AsyncEngine, EngineDeadError, EngineState, QueueFullError, RequestFailedError
from engine.loop.engine_args import EngineArgs
from tests.server.faulty_engine import FAIL, KILL, FaultyEngine


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)  # as the servers in these tests run (see conftest)
    return FaultyEngine.from_engine_args(EngineArgs(max_model_len=256, kv_cache_memory="32MiB", seed=0))


@pytest.fixture
def engine_factory(llm):
    """Each test runs its own AsyncEngine over the module's engine, left clean afterwards."""
    yield lambda: llm
    llm.killed = False
    for request_id in list(llm.requests):
        llm.abort_request(request_id)
    llm.block_manager.check_integrity()
    assert llm.block_manager.device.num_free == llm.block_manager.device.num_blocks


_TOKENIZER: list = []


@pytest.fixture(autouse=True)
def _tokenizer(llm):
    _TOKENIZER[:] = [llm.tokenizer]


async def add(engine, request_id: str, text: str, params: SamplingParams, **kwargs):
    ids = _TOKENIZER[0](text).input_ids
    return await engine.add_request(request_id, ids, params, prompt_text=text, **kwargs)


async def pool_free(engine) -> bool:
    """No KV block in use (asked of the engine thread, between two steps)."""
    m = await engine.block_map()
    return not any(m["ref_counts"]) and m["num_running"] == m["num_waiting"] == 0


def run_with_engine(body, factory, **kw):
    async def main():
        engine = AsyncEngine(factory, **kw)
        engine.start()
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_generate_streams_to_the_end_and_reports_stats(engine_factory, llm):
    seen = []

    async def body(engine):
        await engine.wait_ready()
        ids = _TOKENIZER[0]("The sky is").input_ids
        return [o async for o in engine.generate("r1", ids, SamplingParams(max_tokens=5, temperature=0,
                                                                                    ignore_eos=True))]

    outs = run_with_engine(body, engine_factory, on_stats=seen.append)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert outs[-1].outputs[0].text == llm.tokenizer.decode(outs[-1].outputs[0].token_ids)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(set(lengths)), "outputs must come in order, never repeated"
    assert seen, "on_stats was never called"


def test_cancelling_the_iterator_aborts_the_request(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        ids = _TOKENIZER[0]("Tell me a story").input_ids
        gen = engine.generate("r1", ids, SamplingParams(max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if await pool_free(engine):
                return engine.num_in_flight
            await asyncio.sleep(0.01)
        raise AssertionError("request still in the engine")

    assert run_with_engine(body, engine_factory) == 0


def test_value_error_from_add_leaves_nothing_behind(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("r1", [1] * 250, SamplingParams(max_tokens=10))
        return engine.num_in_flight, engine.num_queued

    assert run_with_engine(body, engine_factory) == (0, 0)


def test_failing_request_is_isolated(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        good = await add(engine, "good", "Count: one, two,", SamplingParams(max_tokens=6, ignore_eos=True))
        bad = await add(engine, "bad", f"{FAIL} here", SamplingParams(max_tokens=6))
        # NOTE: the exception's text goes to the log, not to the caller
        with pytest.raises(RequestFailedError, match="Internal error while generating") as failure:
            async for _ in bad:
                pass
        assert "injected" not in str(failure.value)
        outs = [o async for o in good]
        return outs[-1].outputs[0].finish_reason, len(outs[-1].outputs[0].token_ids), engine.state

    assert run_with_engine(body, engine_factory) == ("length", 6, EngineState.READY)


def test_dead_loop_fails_everything_and_refuses_new_requests(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        stream = await add(engine, "r", f"{KILL} now", SamplingParams(max_tokens=5))
        with pytest.raises((EngineDeadError, RequestFailedError)):
            async for _ in stream:
                pass
        for _ in range(200):
            if engine.state is EngineState.DEAD:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await add(engine, "r2", "a", SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError):
            await engine.block_map()
        return engine.state, engine.dead_reason

    state, reason = run_with_engine(body, engine_factory)
    assert state is EngineState.DEAD and "injected engine death" in reason


def test_load_failure_reports_dead():
    def broken():
        raise RuntimeError("no weights")

    async def body(engine):
        with pytest.raises(EngineDeadError, match="no weights"):
            await engine.wait_ready()
        return engine.state

    assert run_with_engine(body, broken) is EngineState.DEAD


def test_queue_bound(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        engine.check_accepting(2)
        engine.check_accepting(3)  # an empty queue takes any request (else it could never run)
        stream = await add(engine, "waiting", "Hello", SamplingParams(max_tokens=2))
        if engine.num_queued:  # no output yet: it still waits
            engine.check_accepting(1)
            with pytest.raises(QueueFullError):
                engine.check_accepting(2)
        async for _ in stream:
            pass
        engine.release("waiting")
        # A group checked whole (one multi-prompt request) is not refused prompt by prompt.
        engine.check_accepting(3)
        group = [await add(engine, f"g{i}", "Hi", SamplingParams(max_tokens=1), checked=True)
                 for i in range(3)]
        for stream in group:
            async for _ in stream:
                pass
            engine.release(stream.request_id)
        return engine.num_queued

    assert run_with_engine(body, engine_factory, max_queued_requests=2) == 0


def test_queued_count_returns_to_zero(engine_factory):
    async def body(engine):
        await engine.wait_ready()
        streams = [await add(engine, f"r{i}", f"Item {i}:", SamplingParams(max_tokens=2)) for i in range(5)]
        for stream in streams:
            async for _ in stream:
                pass
            engine.release(stream.request_id)
        return engine.num_queued, engine.num_in_flight

    assert run_with_engine(body, engine_factory) == (0, 0)
