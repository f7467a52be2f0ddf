"""benchmarks/step_overhead.py runs end to end on a small case, with and without eviction, and
its figures add up (the overhead is the step less the forward pass; eviction counts as forward)."""

from __future__ import annotations

import pytest

from benchmarks.step_overhead import measure


@pytest.mark.parametrize("evict_mb", [0, 8])
def test_step_overhead_measures_a_small_case(evict_mb):
    r = measure(batch=4, context=64, steps=4, sampling="top_p", evict_mb=evict_mb)
    assert (r["batch"], r["context"], r["sampling"]) == (4, 64, "top_p")
    assert 0 < r["prepare_ms"] and 0 < r["overhead_ms"] < r["step_ms"]
    assert r["forward_ms"] < r["step_ms"]
    assert r["overhead_us_per_seq"] == pytest.approx(r["overhead_ms"] * 1e3 / 4)
