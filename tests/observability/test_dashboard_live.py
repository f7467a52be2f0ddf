"""The KV block map page against the real daemon, in headless Chromium: while streaming
requests run the grid shows blocks in use and none once they end; a running n=3 request's
block tables share its prompt blocks and disappear when it finishes."""

from __future__ import annotations

from tests.observability.obs_support import run_in_threads, stream_completion

PROMPTS = ["Write a long story about a lighthouse keeper who",
           "List the planets of the solar system and describe",
           "Explain how a steam engine works, step by step,",
           "Describe the rules of chess in detail, starting with"]
MAX_TOKENS = 200  # NOTE: long enough to be seen running at 250 ms polls: a quantized step is a few ms
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


def test_an_n3_request_shows_three_tables_sharing_its_prompt_blocks(live_server, page, screenshot_dir):
    """Selecting a running n=3 request shows three block tables whose prompt blocks are the
    same physical blocks (ref count 3), highlighted in the pool; the copy-on-write of the shared
    partial block is in the event log; the tables disappear once the request has finished."""
    import httpx

    url, model = live_server.url, live_server.model()
    prompt = ("Once upon a time in a small village at the edge of a great dark forest there "
              "lived an old woodcutter and his")  # a full 16-token block and a partial one

    def sample_three() -> dict:
        response = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 400, "n": 3, "temperature": 1.0,
            "seed": 2, "ignore_eos": True})  # NOTE: long enough to be seen running between polls
        response.raise_for_status()
        return response.json()

    page.goto(f"{url}/dashboard?interval=250")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)
    threads, results = run_in_threads(sample_three, [()])
    try:
        page.wait_for_selector("#request-list li", timeout=120_000)
        page.click("#request-list li")
        page.wait_for_function("document.querySelectorAll('#tables .seq-table').length == 3",
                               timeout=60_000)
        # NOTE: one evaluate reads the tables, the pool's ref counts and its highlight in the
        # same JS turn: read apart, a poll in between can grow the tables by a block
        snapshot = page.evaluate("""() => ({
            tables: [...document.querySelectorAll('#tables .seq-table')].map(r =>
                [...r.querySelectorAll('.map')].map(m =>
                    [Number(m.dataset.physical), m.classList.contains('shared')])),
            counts: [...document.querySelectorAll('#device-grid .block')].map(c => c.innerText),
            highlighted: [...document.querySelectorAll('#device-grid .block.selected')].map(
                c => [...c.parentNode.children].indexOf(c)),
        })""")
        tables = snapshot["tables"]
        first = [physical for physical, _ in tables[0]]
        assert len(first) >= 2
        for table in tables:
            physical = [p for p, _ in table]
            # the prompt's full block: the same physical block in all three, marked shared
            assert physical[0] == first[0] and table[0][1]
        # ... and the pool map shows its ref count
        assert snapshot["counts"][first[0]] == "3"
        assert set(snapshot["highlighted"]) == {p for table in tables for p, _ in table}
        page.wait_for_selector("#event-log li[data-kind='cow']", timeout=30_000)
        page.screenshot(path=str(screenshot_dir / "dashboard-live-tables.png"), full_page=True)
    finally:
        threads[0].join(timeout=300)
    assert not isinstance(results[0], Exception), results[0]
    assert len(results[0]["choices"]) == 3
    page.wait_for_function("document.querySelectorAll('#tables .seq-table').length == 0", timeout=30_000)
    page.wait_for_function("document.querySelectorAll('#request-list li').length == 0", timeout=30_000)
    assert "may have finished" in page.inner_text("#selected-title")
    page.screenshot(path=str(screenshot_dir / "dashboard-live-tables-after.png"), full_page=True)
    assert page.js_errors == []
