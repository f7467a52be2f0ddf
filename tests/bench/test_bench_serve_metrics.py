"""serve.py's metrics on synthetic timestamps."""

import numpy as np
import pytest

from benchmarks.serve import RequestResult, compute_metrics, format_table, percentile


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 5.0, 1.2, 9.9, 4.4, 4.4, 7.0]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_known_values():
    values = list(range(1, 11))
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([42.0], 99) == 42.0


def test_ttft_tpot_itl_e2e_from_known_timestamps():
    results = [
        # sent at 1.0; first chunk after 100 ms, then gaps of 50, 50, 100 ms
        RequestResult(ok=True, prompt_tokens=10, start=1.0, chunk_times=[1.1, 1.15, 1.2, 1.3],
                      output_tokens=4),
        # sent at 1.5; one chunk carrying 2 tokens (usage says 2): TPOT from usage
        RequestResult(ok=True, prompt_tokens=20, start=1.5, chunk_times=[1.7, 1.9],
                      output_tokens=3),
        RequestResult(ok=False, prompt_tokens=30, start=1.6, error="HTTP 500: boom"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (3, 2, 1)
    assert m["errors"] == ["HTTP 500: boom"]
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["ttft_ms"]["mean"] == pytest.approx((100 + 200) / 2)
    # TPOT: (300 - 100) / 3 and (400 - 200) / 2
    assert m["tpot_ms"]["mean"] == pytest.approx((200 / 3 + 100) / 2)
    # ITL pooled: 50, 50, 100, 200
    assert m["itl_ms"]["mean"] == pytest.approx(100)
    assert m["itl_ms"]["p50"] == pytest.approx(75)
    assert m["e2e_ms"]["p50"] == pytest.approx(350)
    assert m["e2e_ms"]["p99"] == pytest.approx(300 + 100 * 0.99)


def test_single_token_outputs_and_all_failed():
    m = compute_metrics([RequestResult(ok=True, prompt_tokens=1, start=0.0, chunk_times=[0.5],
                                       output_tokens=1)], duration_s=1.0)
    assert m["tpot_ms"]["p50"] is None and m["itl_ms"]["mean"] is None
    assert m["ttft_ms"]["p50"] == pytest.approx(500)
    m = compute_metrics([RequestResult(ok=False, prompt_tokens=1, error="x")], duration_s=0.0)
    assert m["completed"] == 0 and m["request_throughput"] is None
    report = {"label": "t", "num_prompts": 1, "prompt_tokens": {"mean": 1}, "token_counting": "x",
              "max_tokens": 1, "ignore_eos_sent": False, "points": [{"request_rate": "inf", **m}]}
    assert "error: x" in format_table(report)
