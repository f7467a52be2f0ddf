"""Fixtures that run `python -m server` as a subprocess on a free loopback port.

`real_server` (session): the default model, small KV pool, loaded once for the whole session,
through `tests.server.faulty_engine` (the real engine; only prompts carrying a FAULT: marker
misbehave). `start_server(...)` starts one with any flags (tests that need their own flags).
Tests marked `slow` run only when asked for: `-m slow` (tests/conftest.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.support import wait_http_ok

REPO = Path(__file__).resolve().parents[2]
REAL_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--max-num-seqs", "64",
              "--disable-uvicorn-access-log", "--log-level", "warning", "--seed", "0"]
FAULTY = "tests.server.faulty_engine:build"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*flags: str, wait_healthy: bool = True, timeout: float = 180.0,
                 env: dict | None = None) -> ServerProcess:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="paged-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), *flags]
    # NOTE: one intra-op thread: on the 2 shared cores of CI, torch's OpenMP threads spin against
    # the test process and other jobs, and a batched step gets 5-10x slower.
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if "PAGED_SERVE_API_KEY" not in (env or {}):
        full_env.pop("PAGED_SERVE_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, port, log_path)
    if wait_healthy:
        wait_for_health(server, timeout)
    return server


def wait_for_health(server: ServerProcess, timeout: float) -> None:
    state = wait_http_ok(server.url + "/health", timeout, server.proc)
    if state == "ok":
        return
    if state == "exited":
        raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def real_server():
    server = start_server("--engine-factory", FAULTY, *REAL_FLAGS)
    yield server
    code = server.stop()
    assert code == 0, server.log()[-4000:]


@pytest.fixture(scope="session")
def url(real_server) -> str:
    return real_server.url


@pytest.fixture(scope="session")
def client(url):
    """The official `openai` client on the session's real server (no retries: errors show)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id

