"""Metrics fed with synthetic EngineStats: names, labels, counter deltas, histogram events."""

from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.outputs import RequestMetrics
from engine.loop.metrics import EngineStats
from server.observability import METRIC_FAMILIES, Metrics

MODEL = "test-model"
CACHE_INFO = {"block_size": "16", "num_gpu_blocks": "64", "cache_dtype": "float32",
              "preemption_mode": "recompute"}


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample in the exposition as {(name, sorted labels): value}."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def family_names(metrics: Metrics) -> set[str]:
    body, _ = metrics.render()
    names = set()
    for line in body.decode().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
    return names


def finished(arrival: float, prompt: int, generated: int, reason: str = "stop") -> RequestMetrics:
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=arrival + 0.25,
        first_token_time=arrival + 0.5,
        last_token_time=arrival + 1.5,
        finished_time=arrival + 2.0,
        num_prompt_tokens=prompt,
        num_generation_tokens=generated,
        finish_reason=reason,
    )


def test_every_family_exists_before_any_step():
    metrics = Metrics(MODEL, CACHE_INFO)
    assert family_names(metrics) == set(METRIC_FAMILIES)
    samples = scrape(metrics)
    # Families that later issues feed (swap, prefix cache) read 0 from the start.
    for name in ["swap_in_bytes_total", "swap_out_bytes_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "client_disconnects_total"]:
        assert value(samples, "paged_serve:" + name) == 0
    for mode in ["swap", "recompute"]:
        assert value(samples, "paged_serve:num_preemptions_total", mode=mode) == 0
    for reason in ["stop", "length", "abort"]:
        assert value(samples, "paged_serve:request_success_total", finished_reason=reason) == 0


def test_every_sample_carries_the_model_name():
    metrics = Metrics(MODEL, CACHE_INFO)
    metrics.observe(EngineStats(num_running=1, iteration_tokens=3, time_to_first_tokens=[0.1]))
    for (_, labels) in scrape(metrics):
        assert ("model_name", MODEL) in labels


def test_cache_config_info():
    metrics = Metrics(MODEL, {**CACHE_INFO, "swap space": 4, "model_name": "ignored"})
    samples = scrape(metrics)
    labels = dict(next(k[1] for k in samples if k[0] == "paged_serve:cache_config_info"))
    assert labels == {"model_name": MODEL, "block_size": "16", "num_gpu_blocks": "64",
                      "cache_dtype": "float32", "preemption_mode": "recompute",
                      "swap_space": "4"}


def test_the_pool_size_is_exported_before_the_first_step():
    samples = scrape(Metrics(MODEL, CACHE_INFO))
    assert value(samples, "paged_serve:kv_blocks_total") == 64
    assert value(samples, "paged_serve:kv_blocks_free") == 64
    samples = scrape(Metrics(MODEL, {"block_size": "16"}))
    assert value(samples, "paged_serve:kv_blocks_total") == 0


def test_gauges_follow_the_latest_snapshot():
    metrics = Metrics(MODEL, CACHE_INFO)
    metrics.observe(EngineStats(
        num_running=3, num_waiting=2, num_swapped=1, num_device_blocks=64, num_free_device_blocks=40,
        num_cpu_blocks=32, num_free_cpu_blocks=30, kv_cache_usage=24 / 64, cpu_cache_usage=2 / 32,
        kv_internal_fragmentation=0.125, num_shared_blocks=4, num_blocks_saved_by_sharing=6))
    samples = scrape(metrics)
    assert value(samples, "paged_serve:num_requests_running") == 3
    assert value(samples, "paged_serve:num_requests_waiting") == 2
    assert value(samples, "paged_serve:num_requests_swapped") == 1
    assert value(samples, "paged_serve:kv_blocks_total") == 64
    assert value(samples, "paged_serve:kv_blocks_free") == 40
    assert value(samples, "paged_serve:kv_cache_usage_perc") == pytest.approx(0.375)
    assert value(samples, "paged_serve:cpu_cache_usage_perc") == pytest.approx(0.0625)
    assert value(samples, "paged_serve:kv_internal_fragmentation") == pytest.approx(0.125)
    assert value(samples, "paged_serve:kv_shared_blocks") == 4
    assert value(samples, "paged_serve:kv_blocks_saved_by_sharing") == 6

    metrics.observe(EngineStats(num_device_blocks=64, num_free_device_blocks=64))
    samples = scrape(metrics)
    assert value(samples, "paged_serve:num_requests_running") == 0
    assert value(samples, "paged_serve:kv_cache_usage_perc") == 0
    assert value(samples, "paged_serve:kv_blocks_free") == 64


def test_counters_advance_by_the_change_in_cumulative_totals():
    metrics = Metrics(MODEL, CACHE_INFO)
    metrics.observe(EngineStats(
        prompt_tokens_total=10, generation_tokens_total=1, prefix_cache_queries_total=10,
        prefix_cache_hits_total=4, swap_in_bytes_total=0, swap_out_bytes_total=4096,
        num_preemptions_total={"swap": 1, "recompute": 0}))
    metrics.observe(EngineStats(
        prompt_tokens_total=10, generation_tokens_total=5, prefix_cache_queries_total=26,
        prefix_cache_hits_total=12, swap_in_bytes_total=4096, swap_out_bytes_total=4096,
        num_preemptions_total={"swap": 1, "recompute": 2},
        request_success_total={"stop": 1, "length": 2}))
    # A step with nothing new changes no counter.
    metrics.observe(EngineStats(
        prompt_tokens_total=10, generation_tokens_total=5, prefix_cache_queries_total=26,
        prefix_cache_hits_total=12, swap_in_bytes_total=4096, swap_out_bytes_total=4096,
        num_preemptions_total={"swap": 1, "recompute": 2},
        request_success_total={"stop": 1, "length": 2}))
    metrics.client_disconnected()
    samples = scrape(metrics)
    assert value(samples, "paged_serve:prompt_tokens_total") == 10
    assert value(samples, "paged_serve:generation_tokens_total") == 5
    assert value(samples, "paged_serve:prefix_cache_queries_total") == 26
    assert value(samples, "paged_serve:prefix_cache_hits_total") == 12
    assert value(samples, "paged_serve:swap_in_bytes_total") == 4096
    assert value(samples, "paged_serve:swap_out_bytes_total") == 4096
    assert value(samples, "paged_serve:num_preemptions_total", mode="swap") == 1
    assert value(samples, "paged_serve:num_preemptions_total", mode="recompute") == 2
    assert value(samples, "paged_serve:request_success_total", finished_reason="stop") == 1
    assert value(samples, "paged_serve:request_success_total", finished_reason="length") == 2
    assert value(samples, "paged_serve:request_success_total", finished_reason="abort") == 0
    assert value(samples, "paged_serve:client_disconnects_total") == 1


def test_counters_survive_an_engine_restart():
    metrics = Metrics(MODEL, CACHE_INFO)
    metrics.observe(EngineStats(prompt_tokens_total=100))
    metrics.observe(EngineStats(prompt_tokens_total=7))  # a new engine counting from 0
    assert value(scrape(metrics), "paged_serve:prompt_tokens_total") == 107


def test_histograms_take_the_steps_events():
    metrics = Metrics(MODEL, CACHE_INFO)
    metrics.observe(EngineStats(iteration_tokens=12, time_to_first_tokens=[0.03, 0.2]))
    metrics.observe(EngineStats(iteration_tokens=2, inter_token_latencies=[0.02, 0.04]))
    metrics.observe(EngineStats(
        iteration_tokens=2, inter_token_latencies=[0.03],
        finished_requests=[finished(100.0, prompt=5, generated=3),
                           finished(101.0, prompt=7, generated=40, reason="length")]))
    metrics.observe(EngineStats())  # an idle step is not an iteration
    samples = scrape(metrics)

    def count(name):
        return value(samples, f"paged_serve:{name}_count")

    def total(name):
        return value(samples, f"paged_serve:{name}_sum")

    assert count("iteration_tokens") == 3 and total("iteration_tokens") == 16
    assert count("time_to_first_token_seconds") == 2
    assert total("time_to_first_token_seconds") == pytest.approx(0.23)
    assert count("inter_token_latency_seconds") == 3
    assert total("inter_token_latency_seconds") == pytest.approx(0.09)
    assert count("e2e_request_latency_seconds") == 2
    assert total("e2e_request_latency_seconds") == pytest.approx(4.0)
    assert count("request_queue_time_seconds") == 2
    assert total("request_queue_time_seconds") == pytest.approx(0.5)
    assert total("request_prompt_tokens") == 12
    assert total("request_generation_tokens") == 43
    # Bucket edges: the 0.03 s TTFT lands at le=0.04, not le=0.02.
    assert value(samples, "paged_serve:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert value(samples, "paged_serve:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(samples, "paged_serve:request_generation_tokens_bucket", le="50.0") == 2


def test_a_request_that_never_ran_skips_the_latency_histograms():
    metrics = Metrics(MODEL, CACHE_INFO)
    aborted = RequestMetrics(arrival_time=1.0, finished_time=1.5, num_prompt_tokens=4,
                             finish_reason="abort")
    metrics.observe(EngineStats(finished_requests=[aborted]))
    samples = scrape(metrics)
    assert value(samples, "paged_serve:e2e_request_latency_seconds_count") == 1
    assert value(samples, "paged_serve:request_queue_time_seconds_count") == 0


def test_two_servers_in_one_process_do_not_clash():
    a, b = Metrics("a", CACHE_INFO), Metrics("b", CACHE_INFO)
    a.observe(EngineStats(prompt_tokens_total=5))
    assert b"paged_serve:prompt_tokens_total{model_name=\"b\"} 0.0" in b.render()[0]
    assert b"model_name=\"a\"" not in b.render()[0]


def test_observe_is_thread_safe():
    metrics = Metrics(MODEL, CACHE_INFO)
    steps_per_thread, threads = 200, 4
    lock = threading.Lock()
    totals = {"prompt": 0}

    def engine_like():
        for _ in range(steps_per_thread):
            with lock:  # the engine's totals only grow; observers may interleave with scrapes
                totals["prompt"] += 1
                stats = EngineStats(prompt_tokens_total=totals["prompt"], iteration_tokens=1)
            metrics.observe(stats)
            metrics.render()

    workers = [threading.Thread(target=engine_like) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    samples = scrape(metrics)
    assert value(samples, "paged_serve:iteration_tokens_count") == steps_per_thread * threads
