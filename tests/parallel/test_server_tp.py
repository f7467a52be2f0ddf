"""The daemon with --tensor-parallel-size 3 serves, and when a worker dies answers errors (never
hangs), reports it on /health and stops cleanly, leaving no worker behind. (A size that does
not split the model is refused before any worker starts: test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--swap-space", "0.02", "--quantization", "none",
         "--log-level", "warning", "--disable-uvicorn-access-log"]
ENV = {"PAGED_SERVE_TP_TIMEOUT": "20"}


def tp_workers(server_pid: int) -> list[int]:
    """Pids of the tensor-parallel workers the server started (torch.multiprocessing spawn)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmd:
            pids.append(int(d.name))
    return pids


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_a_worker_and_check(flags: list[str], num_workers: int, reason: str) -> None:
    """Start the daemon with `flags`, check it serves, SIGKILL one of its `num_workers` workers,
    then: requests fail fast (no hang in a collective) until /health turns 503 naming `reason`,
    SIGTERM stops the daemon, and no worker outlives it."""
    server = start_server(*flags, env=ENV, timeout=120)
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The lighthouse keeper", "max_tokens": 6,
                "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        workers = tp_workers(server.proc.pid)
        assert len(workers) == num_workers, workers
        os.kill(workers[0], signal.SIGKILL)

        deadline = time.monotonic() + 60
        health = httpx.get(server.url + "/health", timeout=5)
        while health.status_code == 200 and time.monotonic() < deadline:
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code >= 500 and time.monotonic() - t0 < 15, r.text
            health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert reason in health.json().get("reason", ""), health.text
    finally:
        code = server.stop(signal.SIGTERM, timeout=30)
    assert code is not None
    time.sleep(1)
    assert not [p for p in workers if alive(p)], "a worker outlived the server"


@pytest.mark.timeout(150)
def test_daemon_reports_a_dead_worker_and_stops_cleanly():
    kill_a_worker_and_check(["--tensor-parallel-size", "3", *FLAGS], 2, "worker rank")
