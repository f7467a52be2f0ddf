"""The start-up calibration of the step-time model (engine/loop/step_calibration.py), on a real engine
(tiny dummy-weights model): the model answers afterwards, and nothing else of the calibration's
requests is left (pool, prefix cache, totals, counters)."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine
from engine.loop.step_calibration import calibrate_step_cost


def engine(**kw) -> LLMEngine:
    args = dict(model="tiny-4kv", load_format="dummy", max_model_len=256, block_size=16,
                kv_cache_memory="4MiB", enable_prefix_caching=True, seed=0)
    return LLMEngine.from_engine_args(EngineArgs(**(args | kw)))


def test_calibration_trains_the_model_and_leaves_a_fresh_engine():
    e = engine()
    assert e.scheduler.step_cost is not None and e.scheduler.step_cost.coefficients() is None
    steps = []
    real_step = e.step
    e.step = lambda: steps.append(1) or real_step()
    assert calibrate_step_cost(e)
    assert e.scheduler.step_cost.coefficients() is not None and 8 <= len(steps) <= 48
    bm = e.block_manager
    assert not e.requests and not e.has_unfinished_requests()
    assert list(bm.device.free) == list(range(bm.device.num_blocks)) and not bm.device.cached
    assert not bm.device.by_hash and bm.prefix_queries == bm.prefix_hits == bm.prefix.num_hashes == 0
    bm.check_integrity()
    assert e.stats.generation_tokens == e.stats.prompt_tokens == 0 and not e.stats.success
    assert e.scheduler.num_preemptions == {"swap": 0, "recompute": 0} and not e.scheduler.events.recent()
    # a second call has nothing to learn: no step runs
    assert calibrate_step_cost(e) and len(steps) <= 48
    before = len(steps)
    calibrate_step_cost(e)
    assert len(steps) == before
    # and the engine serves as before: a first request gets block 0
    e.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=3, temperature=0.0))
    e.step()
    assert bm.tables[e.requests["r"].seqs[0].seq_id][0] == 0


def test_nothing_runs_without_a_step_time_target_or_with_requests_queued():
    e = engine(target_itl_ms=0)
    assert e.scheduler.step_cost is None and not calibrate_step_cost(e)
    e = engine()
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not calibrate_step_cost(e)
    assert list(e.requests) == ["r"] and e.scheduler.step_cost.coefficients() is None
    with pytest.raises(RuntimeError, match="in flight"):  # the reset calibration ends with
        e.reset()
