"""The daemon with --pipeline-parallel-size 2 serves the default model (its GGUF weights as
stored: every rank loads them, then keeps its stage's layers), and when the second stage dies
answers errors (never hangs), turns /health 503 and stops cleanly, leaving no worker behind,
as with a dead tensor-parallel worker (test_server_tp.py)."""

from __future__ import annotations

import pytest

from tests.parallel.test_server_tp import kill_a_worker_and_check

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--swap-space", "0.02",
         "--log-level", "warning", "--disable-uvicorn-access-log"]


@pytest.mark.timeout(150)
def test_daemon_reports_a_dead_stage_and_stops_cleanly():
    kill_a_worker_and_check(["--pipeline-parallel-size", "2", *FLAGS], 1, "pipeline stage 1")
