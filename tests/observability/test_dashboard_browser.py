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
        "requests": extra.get("requests", []),
        "num_requests_with_blocks": len(extra.get("requests", [])),
        "events": extra.pop("events", []),
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
        self.tables: dict[str, dict] = {}  # request id -> its /kv/requests body
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

        @app.get("/kv/requests/{request_id}")
        def kv_request(request_id: str):
            if request_id not in self.tables:
                return JSONResponse({"error": {"message": "gone"}}, status_code=404)
            return self.tables[request_id]

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


def seq_table(index, blocks, refs, hits=(), pool="device", status="running"):
    return {"index": index, "status": status, "num_tokens": 16 * len(blocks) - 3, "pool": pool,
            "blocks": blocks, "ref_counts": refs,
            "prefix_hit": [i < len(hits) and hits[i] for i in range(len(blocks))]}


def test_selecting_a_request_shows_its_tables_and_highlights_its_blocks(page, screenshot_dir):
    requests = [{"request_id": "cmpl-a-0", "status": "running", "num_seqs": 2, "num_blocks": 4,
                 "beam_search": False},
                {"request_id": "cmpl-b-0", "status": "swapped", "num_seqs": 1, "num_blocks": 2,
                 "beam_search": False}]
    events = [{"id": 1, "time": 1.7e9, "kind": "cow", "request_id": "cmpl-a-0", "seq_index": 1,
               "logical_block": 2, "src": 11, "dst": 40, "num_blocks": None},
              {"id": 2, "time": 1.7e9 + 1, "kind": "swap_out", "request_id": "cmpl-b-0", "seq_index": None,
               "logical_block": None, "src": None, "dst": None, "num_blocks": 2}]
    busy = block_map([USED] * 10 + [SHARED] * 2 + [FREE] * 52, ref_counts=[1] * 10 + [2, 2] + [0] * 52,
                     cpu_blocks=[SWAPPED] * 2 + [CPU_FREE] * 14, requests=requests, events=events)
    with StandIn() as server:
        server.state = busy
        server.tables["cmpl-a-0"] = {
            "request_id": "cmpl-a-0", "status": "running", "block_size": 16, "num_cached_tokens": 16,
            "sequences": [seq_table(0, [10, 11, 3], [2, 2, 1], hits=[True]),
                          seq_table(1, [10, 11, 40], [2, 2, 1], hits=[True])]}
        page.goto(server.url("?interval=200"))
        page.wait_for_selector("#request-list li[data-request-id='cmpl-b-0']")
        assert page.locator("#request-list li").count() == 2
        assert "swapped" in page.inner_text("#request-list li[data-request-id='cmpl-b-0']")
        # The event log: newest first, each event said in words.
        log = page.locator("#event-log li")
        assert log.count() == 2 and log.nth(0).get_attribute("data-kind") == "swap_out"
        assert "logical block 2 copied, physical 11 → 40" in log.nth(1).inner_text()

        page.click("#request-list li[data-request-id='cmpl-a-0']")
        page.wait_for_function("document.querySelectorAll('#tables .seq-table').length == 2")
        rows = page.locator("#tables .seq-table")
        assert [rows.nth(i).locator(".map").count() for i in range(2)] == [3, 3]
        assert rows.nth(0).locator(".map.shared").count() == 2  # blocks 10 and 11, ref count 2
        assert rows.nth(1).locator(".map.hit").count() == 1
        assert rows.nth(1).locator(".map").nth(2).inner_text() == "2→40"
        selected = page.eval_on_selector_all(
            "#device-grid .block.selected", "cells => cells.map(c => [...c.parentNode.children].indexOf(c))")
        assert sorted(selected) == [3, 10, 11, 40]
        assert page.locator("#request-list li.selected").count() == 1
        page.screenshot(path=str(screenshot_dir / "dashboard-standin-tables.png"), full_page=True)

        # The request finishes: its tables go, and so does the highlight.
        del server.tables["cmpl-a-0"]
        server.state = IDLE
        page.wait_for_function("document.querySelectorAll('#tables .seq-table').length == 0")
        # NOTE: the tables and the block map are separate fetches: the list may lag one poll.
        page.wait_for_function("document.querySelectorAll('#request-list li').length == 0")
        assert "may have finished" in page.inner_text("#selected-title")
        assert page.locator("#device-grid .block.selected").count() == 0
        assert page.locator("#request-list li").count() == 0
    assert page.js_errors == []
