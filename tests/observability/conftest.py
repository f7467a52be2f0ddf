"""Fixtures for the observability tests: a headless Chromium page (skipped when unavailable)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.observability.obs_support import LIVE_FLAGS, LiveServer, chromium_path


# NOTE: module scope, not session: while Playwright's sync API is open it keeps an event loop
# running on this thread, and every later test that calls asyncio.run() would fail.
@pytest.fixture(scope="module")
def browser():
    """A headless Chromium driven by Python playwright; skips when either is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium: apt-get install -y chromium")
    with sync_api.sync_playwright() as playwright:
        # NOTE: --no-sandbox because tests run as root here; the page is our own.
        browser = playwright.chromium.launch(executable_path=path, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    yield page
    context.close()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    """Where screenshots go: $DASHBOARD_SCREENSHOT_DIR to keep them, else the test's tmp dir."""
    keep = os.environ.get("DASHBOARD_SCREENSHOT_DIR")
    path = Path(keep) if keep else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def live_server():
    """The real daemon with the default model, shared by the live tests of this folder."""
    server = LiveServer(*LIVE_FLAGS)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
