"""The daemon with --pipeline-parallel-size 2 serves the default model (its GGUF weights as
stored: every rank loads them, then keeps its stage's layers), and when the second stage dies
answers errors (never hangs), turns /health 503 and stops cleanly, leaving no worker behind,
as with a dead tensor-parallel worker (test_server_tp.py)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.parallel.test_server_tp import ENV, alive, tp_workers
from tests.server.conftest import start_server

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--swap-space", "0.02",
         "--log-level", "warning", "--disable-uvicorn-access-log"]


@pytest.mark.timeout(150)
def test_daemon_reports_a_dead_stage_and_stops_cleanly():
    server = start_server("--pipeline-parallel-size", "2", *FLAGS, env=ENV, timeout=120)
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The lighthouse keeper", "max_tokens": 6,
                "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        workers = tp_workers(server.proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)

        deadline = time.monotonic() + 60
        health = httpx.get(server.url + "/health", timeout=5)
        while health.status_code == 200 and time.monotonic() < deadline:
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code >= 500 and time.monotonic() - t0 < 15, r.text
            health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert "pipeline stage 1" in health.json().get("reason", ""), health.text
    finally:
        code = server.stop(signal.SIGTERM, timeout=30)
    assert code is not None
    time.sleep(1)
    assert not [p for p in workers if alive(p)], "a worker outlived the server"
