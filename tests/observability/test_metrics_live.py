"""GET /metrics of the real daemon, scraped while streaming requests run and after they end."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.observability import METRIC_FAMILIES
from tests.observability.obs_support import run_in_threads, stream_completion

PROMPTS = ["The history of the printing press", "A recipe for lemon cake",
           "Why the sky is blue", "How bicycles stay upright"]
MAX_TOKENS = 200  # NOTE: long enough to be scraped while running: a quantized step is a few ms


def scrape(url: str) -> dict[str, float]:
    """Samples summed over label sets, by sample name (one model per server)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_every_family_is_exported(live_server):
    text = httpx.get(f"{live_server.url}/metrics", timeout=30).text
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert set(METRIC_FAMILIES) <= declared
    assert f'model_name="{live_server.model()}"' in text


def test_metrics_while_requests_run_and_after(live_server):
    url, model = live_server.url, live_server.model()
    before = scrape(url)
    assert before["paged_serve:kv_blocks_total"] > 0

    threads, results = run_in_threads(
        stream_completion, [(url, model, prompt, MAX_TOKENS) for prompt in PROMPTS])
    # While they run: requests in the batch, blocks in use, first tokens timed.
    seen_running = seen_usage = seen_ttft = False
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        during = scrape(url)
        seen_running |= during["paged_serve:num_requests_running"] > 0
        seen_usage |= during["paged_serve:kv_cache_usage_perc"] > 0
        seen_ttft |= (during["paged_serve:time_to_first_token_seconds_count"]
                      > before["paged_serve:time_to_first_token_seconds_count"])
        if seen_running and seen_usage and seen_ttft:
            assert 0 <= during["paged_serve:kv_internal_fragmentation"] < 1
            assert during["paged_serve:kv_blocks_free"] < during["paged_serve:kv_blocks_total"]
            break
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=300)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    assert seen_running and seen_usage and seen_ttft

    # After: the pool is free again and the counters equal what was sent.
    deadline = time.monotonic() + 10
    while True:
        after = scrape(url)
        if after["paged_serve:num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert after["paged_serve:num_requests_running"] == 0
    assert after["paged_serve:num_requests_waiting"] == 0
    assert after["paged_serve:kv_cache_usage_perc"] == 0
    assert after["paged_serve:kv_blocks_free"] == after["paged_serve:kv_blocks_total"]
    assert 0 <= after["paged_serve:kv_internal_fragmentation"] < 1
    assert delta("paged_serve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in results)
    assert delta("paged_serve:generation_tokens_total") == sum(u["completion_tokens"] for u in results)
    assert delta("paged_serve:request_success_total") == len(PROMPTS)
    assert delta("paged_serve:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert delta("paged_serve:time_to_first_token_seconds_count") == len(PROMPTS)
    generated = [u["completion_tokens"] for u in results]
    assert delta("paged_serve:request_generation_tokens_sum") == sum(generated)
    assert delta("paged_serve:inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    # Every step's tokens: each prompt once (less what the prefix cache served), then one
    # token per decode step (the last sampled token is never fed back).
    assert delta("paged_serve:iteration_tokens_sum") == (
        sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in results)
        - delta("paged_serve:prefix_cache_hits_total"))
