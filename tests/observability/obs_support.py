"""Helpers shared by the observability tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DASHBOARD_HTML = Path(__file__).resolve().parents[2] / "server" / "static" / "dashboard.html"


def chromium_path() -> str | None:
    """Debian's chromium (apt-get install chromium), or $CHROMIUM_PATH."""
    for candidate in (os.environ.get("CHROMIUM_PATH"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the real daemon, as a subprocess ------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# A small pool (a couple of hundred blocks) so that a few requests visibly fill it.
LIVE_FLAGS = ["--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "8",
              "--seed", "0", "--disable-uvicorn-access-log", "--log-level", "warning"]


class LiveServer:
    """`python -m server` on a free loopback port with the default model."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="paged-serve-obs-", suffix=".log")[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PAGED_SERVE_API_KEY", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(self.port),
                 *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"no healthy server in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def model(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion, read to the end; returns its final usage block."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
    assert usage is not None, "no usage in the stream"
    return usage


def run_in_threads(fn, args_list: list[tuple]) -> tuple[list[threading.Thread], list]:
    """Start fn(*args) for each args in threads; results (or exceptions) land in the list."""
    results: list = [None] * len(args_list)

    def worker(i: int, args: tuple) -> None:
        try:
            results[i] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i, a), daemon=True)
               for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results
