"""The KV block map page against the real daemon, in headless Chromium: while streaming
requests run the grid shows blocks in use, and once they end it shows none."""

from __future__ import annotations

from tests.observability.obs_support import run_in_threads, stream_completion

PROMPTS = ["Write a long story about a lighthouse keeper who",
           "List the planets of the solar system and describe",
           "Explain how a steam engine works, step by step,",
           "Describe the rules of chess in detail, starting with"]
MAX_TOKENS = 24
IN_USE = "document.querySelectorAll('#device-grid .block.used, #device-grid .block.shared').length"


def test_grid_shows_blocks_while_requests_run_and_none_after(live_server, page, screenshot_dir):
    url, model = live_server.url, live_server.model()
    page.goto(f"{url}/dashboard?interval=250")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)
    num_blocks = page.locator("#device-grid .block").count()
    assert num_blocks > 0
    page.wait_for_function(f"{IN_USE} == 0", timeout=30_000)  # idle before we start

    threads, results = run_in_threads(
        stream_completion, [(url, model, prompt, MAX_TOKENS) for prompt in PROMPTS])
    try:
        page.wait_for_function(f"{IN_USE} >= {len(PROMPTS)}", timeout=120_000)
        page.wait_for_function("Number(document.getElementById('num-running').textContent) > 0",
                               timeout=30_000)
        in_use = page.evaluate(IN_USE)
        assert 0 < in_use < num_blocks
        assert page.inner_text("#usage") != "0.0%"
        page.screenshot(path=str(screenshot_dir / "dashboard-live-running.png"), full_page=True)
    finally:
        for t in threads:
            t.join(timeout=300)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors

    page.wait_for_function(f"{IN_USE} == 0", timeout=30_000)
    page.wait_for_function("document.getElementById('num-running').textContent === '0'",
                           timeout=30_000)
    assert page.inner_text("#usage") == "0.0%"
    assert page.locator("#device-grid .block").count() == num_blocks
    page.screenshot(path=str(screenshot_dir / "dashboard-live-after.png"), full_page=True)
    assert page.js_errors == []


def test_parallel_sampling_shows_shared_blocks_with_their_ref_count(live_server, page,
                                                                   screenshot_dir):
    """n=3 forks one prompt into three sequences: the prompt's full blocks are shared by all
    three (ref count 3) until the request ends."""
    import httpx

    from tests.observability.obs_support import run_in_threads

    url, model = live_server.url, live_server.model()
    prompt = ("Once upon a time in a small village at the edge of a great dark forest there "
              "lived an old woodcutter and his")  # more than one 16-token block

    def sample_three() -> dict:
        response = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 24, "n": 3, "temperature": 1.0,
            "seed": 1})
        response.raise_for_status()
        return response.json()

    page.goto(f"{url}/dashboard?interval=250")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)
    threads, results = run_in_threads(sample_three, [()])
    try:
        page.wait_for_function(
            "[...document.querySelectorAll('#device-grid .block.shared')]"
            ".some(b => b.textContent === '3')", timeout=120_000)
        page.screenshot(path=str(screenshot_dir / "dashboard-live-shared.png"), full_page=True)
    finally:
        threads[0].join(timeout=300)
    assert not isinstance(results[0], Exception), results[0]
    assert len(results[0]["choices"]) == 3
    page.wait_for_function(f"{IN_USE} == 0", timeout=30_000)
    assert page.js_errors == []
