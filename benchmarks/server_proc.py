"""A benchmark's own server: `python -m server` on a free loopback port, polled on GET /health
until it answers 200 (or the process dies, or `timeout` passes), terminated when the benchmark
is done. Shared by the benchmarks that take `--start -- <server flags>` or `--url`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def split_server_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, the server flags after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def start_server(flags: list[str], env: dict[str, str] | None = None,
                 timeout: float = 300.0, repo: Path = REPO, stdout=None) -> tuple[subprocess.Popen, str]:
    """Start `python -m server` with `flags` (environment `env`, default: this process's) from
    the checkout `repo` (default: this one; another one compares versions) and wait until GET
    /health answers 200. Returns (process, base url).

    Raises SystemExit if the server exits first, or (after killing it) is not healthy within
    `timeout` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str = "server") -> None:
    """Poll GET `url`/health until it answers 200. Raises SystemExit if `proc` exits first, or
    (after killing it) when `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{what} did not become healthy")


@contextmanager
def server_for(url: str | None, start: bool, flags: list[str],
               env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen | None]]:
    """(url, None) for a running server at `url`; with no `url`, or with `start`, (url, process)
    of a server started with `flags`, terminated on leaving the block."""
    if url is not None and not start:
        yield url, None
        return
    proc, url = start_server(flags, env)
    try:
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)
