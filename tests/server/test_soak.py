"""The soak (`benchmarks/soak.py`) in short, on the shared real server: 40 mixed requests from
8 concurrent clients (streaming, non-streaming, n > 1, clients that disconnect at random
points), then every request that stayed connected got a valid complete body, the server is
healthy, its KV pool all free, and its RSS grew less than the bound. The full run (500 requests,
64 clients) is `python benchmarks/soak.py --start`, or `-m slow` here."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import run_soak


def check(report) -> None:
    summary = json.dumps(report.as_dict(), indent=1)
    print("\n" + summary)
    assert report.ok, summary
    assert report.completed + report.disconnected == report.requests
    assert report.disconnected > 0, "no client walked away: the mix did not test disconnects"
    assert report.healthy_after and report.pool_free_after_s >= 0


def test_soak_short(real_server):
    check(run_soak(real_server.url, real_server.proc.pid, requests=40, clients=8, max_tokens=4,
                   rss_bound_mib=128, timeout=300))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_full(real_server):
    check(run_soak(real_server.url, real_server.proc.pid, requests=500, clients=64, max_tokens=16,
                   rss_bound_mib=256, timeout=900))
