"""The KV block map page in a real headless Chromium, against a small stand-in server.

The stand-in serves server/static/dashboard.html at /dashboard and a /kv/blocks whose content
the test changes between polls, so the page's drawing is checked state by state. The same page
against the real daemon is in test_dashboard_live.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.observability.obs_support import DASHBOARD_HTML, free_port

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
# NOTE: at module level: FastAPI resolves the string annotations of routes in module globals.
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import FileResponse, JSONResponse  # noqa: E402

FREE, USED, SHARED, CACHED = 0, 1, 2, 3
CPU_FREE, SWAPPED = 0, 4


def block_map(blocks, ref_counts=None, cpu_blocks=(), **extra) -> dict:
    """A /kv/blocks body in the engine's block_map() shape."""
    blocks = list(blocks)
    used = sum(1 for b in blocks if b in (USED, SHARED))
    return {
        "block_size": 16,
        "num_blocks": len(blocks),
        "num_cpu_blocks": len(cpu_blocks),
        "blocks": blocks,
        "ref_counts": list(ref_counts or [1 if b in (USED, SHARED) else 0 for b in blocks]),
        "cpu_blocks": list(cpu_blocks),
        "usage": used / len(blocks),
        "fragmentation": extra.pop("fragmentation", 0.0),
        "num_running": extra.pop("num_running", 0),
        "num_waiting": extra.pop("num_waiting", 0),
        "num_swapped": extra.pop("num_swapped", 0),
    }


IDLE = block_map([FREE] * 64, cpu_blocks=[CPU_FREE] * 16)
BUSY = block_map(
    [USED] * 10 + [SHARED] * 2 + [CACHED] * 3 + [FREE] * 49,
    ref_counts=[1] * 10 + [3, 2] + [0] * 52,
    cpu_blocks=[SWAPPED] * 4 + [CPU_FREE] * 12,
    fragmentation=0.25, num_running=3, num_waiting=1, num_swapped=1,
)


class StandIn:
    """A FastAPI app on a loopback port serving the dashboard and a settable /kv/blocks."""

    def __init__(self, api_key: str | None = None):
        self.state = IDLE
        self.status_code = 200  # anything else: answer with an error body instead
        self.polls = 0
        app = FastAPI()

        @app.get("/dashboard")
        def dashboard():
            return FileResponse(DASHBOARD_HTML, media_type="text/html")

        @app.get("/kv/blocks")
        def kv_blocks(request: Request):
            if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            self.polls += 1
            if self.status_code != 200:
                return JSONResponse({"error": {"message": "not now"}}, status_code=self.status_code)
            return self.state

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def url(self, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/dashboard{query}"


def wait_for_updates(page, count: int, timeout_ms: int = 10_000) -> None:
    """Wait until the page has drawn `count` block maps in all."""
    page.wait_for_function(f"Number(document.body.dataset.updates || 0) >= {count}",
                           timeout=timeout_ms)


def cells(page, grid: str, state: str) -> int:
    return page.locator(f"#{grid} .block.{state}").count()


def test_grid_follows_the_block_map(page, screenshot_dir):
    with StandIn() as server:
        page.goto(server.url("?interval=200"))
        wait_for_updates(page, 1)
        assert page.locator("#device-grid .block").count() == 64
        assert cells(page, "device-grid", "used") == 0
        assert page.locator("#cpu-grid .block").count() == 16

        server.state = BUSY
        page.wait_for_function("document.querySelectorAll('#device-grid .block.used').length > 0")
        assert cells(page, "device-grid", "used") == 10
        assert cells(page, "device-grid", "shared") == 2
        assert cells(page, "device-grid", "cached") == 3
        assert cells(page, "device-grid", "free") == 49
        assert cells(page, "cpu-grid", "swapped") == 4
        # Shared blocks show their reference count.
        shared = page.locator("#device-grid .block.shared")
        assert [shared.nth(i).inner_text() for i in range(2)] == ["3", "2"]
        assert "ref count 3" in shared.nth(0).get_attribute("title")
        assert page.inner_text("#usage") == "18.8%"  # 12 of 64 blocks
        assert page.inner_text("#fragmentation") == "25.0%"
        assert page.inner_text("#num-running") == "3"
        assert page.inner_text("#num-waiting") == "1"
        assert page.inner_text("#num-swapped") == "1"
        assert page.inner_text("#blocks-used") == "12 / 64"
        assert page.inner_text("#count-swapped") == "4"
        page.screenshot(path=str(screenshot_dir / "dashboard-standin-busy.png"), full_page=True)

        server.state = IDLE
        page.wait_for_function("document.querySelectorAll('#device-grid .block.used').length == 0")
        assert cells(page, "device-grid", "shared") == 0
        assert cells(page, "cpu-grid", "swapped") == 0
        assert page.inner_text("#usage") == "0.0%"
    assert page.js_errors == []


def test_polls_about_once_a_second_by_default(page):
    with StandIn() as server:
        page.goto(server.url())
        wait_for_updates(page, 1)
        start = server.polls
        time.sleep(3.2)
        assert 2 <= server.polls - start <= 5


def test_pool_resizes_when_the_server_changes(page):
    with StandIn() as server:
        page.goto(server.url("?interval=200"))
        wait_for_updates(page, 1)
        server.state = block_map([USED] * 5000, cpu_blocks=[])
        page.wait_for_function("document.querySelectorAll('#device-grid .block').length == 5000")
        assert cells(page, "device-grid", "used") == 5000
        # A large pool gets small cells so that it fits on a screen.
        assert page.eval_on_selector("#device-grid", "g => g.classList.contains('small')")


def test_api_key_from_the_query_string(page):
    with StandIn(api_key="sekrit") as server:
        page.goto(server.url("?interval=200"))
        page.wait_for_selector("#key-form.visible")
        assert "unauthorized" in page.inner_text("#status")

        page.goto(server.url("?interval=200&key=sekrit"))
        wait_for_updates(page, 1)
        assert "live" in page.inner_text("#status")


def test_a_server_that_goes_away_is_reported(page):
    with StandIn() as server:
        url = server.url("?interval=200")
        page.goto(url)
        wait_for_updates(page, 1)
    page.wait_for_function("document.getElementById('status').classList.contains('error')")
    assert "unreachable" in page.inner_text("#status")


def test_a_loading_server_is_reported_then_drawn(page):
    with StandIn() as server:
        server.status_code = 503
        page.goto(server.url("?interval=200"))
        page.wait_for_function("document.getElementById('status').textContent.includes('loading')")
        assert "error" not in page.get_attribute("#status", "class")
        server.status_code = 200
        wait_for_updates(page, 1)
        assert "live" in page.inner_text("#status")
