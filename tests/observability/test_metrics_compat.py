"""--metrics-compat vllm: the names vLLM-built gateways and dashboards read, with our values.

Unit tests feed synthetic EngineStats; the live test scrapes a real daemon started with the
flag after real requests, and checks every vLLM sample against the `paged_serve:` one it copies.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.loop.metrics import EngineStats
from server.observability import METRIC_FAMILIES, Metrics
from tests.observability.obs_support import LIVE_FLAGS, LiveServer, stream_completion
from tests.observability.test_metrics_unit import CACHE_INFO, MODEL, finished

# What the Gateway API Inference Extension's endpoint picker, the vLLM production-stack router
# and vLLM's Grafana dashboard query, as they appear in the exposition.
VLLM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:cache_config_info",
}
# vLLM name -> ours, where they differ by more than the prefix.
OURS = {"vllm:gpu_cache_usage_perc": "paged_serve:kv_cache_usage_perc",
        "vllm:time_per_output_token_seconds": "paged_serve:inter_token_latency_seconds",
        "vllm:iteration_tokens_total": "paged_serve:iteration_tokens"}


def parse(text: str) -> tuple[set[str], dict[tuple[str, tuple], float]]:
    """The families declared (# TYPE lines) and every sample as {(name, labels): value}."""
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return declared, samples


def our_sample(samples: dict, name: str, labels: tuple) -> float:
    """The `paged_serve:` value that the vLLM sample (`name`, `labels`) copies."""
    for theirs, ours in OURS.items():
        if name.startswith(theirs):
            return samples[(ours + name[len(theirs):], labels)]
    ours = "paged_serve:" + name[len("vllm:"):]
    if ours.startswith("paged_serve:num_preemptions"):  # summed over our `mode` label
        return sum(v for (n, ls), v in samples.items() if n == ours and set(labels) <= set(ls))
    return samples[(ours, labels)]


def assert_vllm_copies_ours(text: str) -> dict:
    """Every vLLM family is there and every vLLM sample equals ours; returns the samples."""
    declared, samples = parse(text)
    assert VLLM_FAMILIES <= declared, VLLM_FAMILIES - declared
    assert set(METRIC_FAMILIES) <= declared  # ours stay
    vllm = [(key, v) for key, v in samples.items() if key[0].startswith("vllm:")]
    assert vllm
    for (name, labels), value in vllm:
        assert value == our_sample(samples, name, labels), (name, labels)
    return samples


def test_no_vllm_names_without_the_flag():
    body, _ = Metrics(MODEL, CACHE_INFO).render()
    assert "vllm:" not in body.decode()


def test_an_unknown_compat_mode_is_refused():
    with pytest.raises(ValueError, match="sglang"):
        Metrics(MODEL, CACHE_INFO, compat="sglang")


def test_vllm_names_copy_synthetic_steps():
    metrics = Metrics(MODEL, CACHE_INFO, compat="vllm")
    metrics.observe(EngineStats(
        num_running=3, num_waiting=2, num_device_blocks=64, num_free_device_blocks=40,
        kv_cache_usage=24 / 64, iteration_tokens=12, time_to_first_tokens=[0.03, 0.2],
        prompt_tokens_total=10, generation_tokens_total=2, prefix_cache_queries_total=10,
        prefix_cache_hits_total=4, num_preemptions_total={"swap": 1, "recompute": 2}))
    metrics.observe(EngineStats(
        num_running=1, num_waiting=0, num_device_blocks=64, num_free_device_blocks=60,
        kv_cache_usage=4 / 64, iteration_tokens=2, inter_token_latencies=[0.02, 0.04],
        finished_requests=[finished(100.0, prompt=5, generated=3)],
        request_success_total={"stop": 1}, prompt_tokens_total=10, generation_tokens_total=4,
        prefix_cache_queries_total=10, prefix_cache_hits_total=4,
        num_preemptions_total={"swap": 1, "recompute": 2}))
    samples = assert_vllm_copies_ours(metrics.render()[0].decode())
    model = (("model_name", MODEL),)
    assert samples[("vllm:num_requests_running", model)] == 1
    assert samples[("vllm:kv_cache_usage_perc", model)] == pytest.approx(4 / 64)
    assert samples[("vllm:num_preemptions_total", model)] == 3  # one series, as on vLLM
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"),) + model)] == 1
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 2
    assert samples[("vllm:iteration_tokens_total_sum", model)] == 14


@pytest.fixture(scope="module")
def compat_server():
    server = LiveServer(*LIVE_FLAGS, "--metrics-compat", "vllm")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_a_real_server_exports_vllm_names_with_our_values(compat_server):
    url, model = compat_server.url, compat_server.model()
    # NOTE: longer than a few 16-token blocks, so the second request finds full blocks cached.
    prompt = "The history of the printing press, from movable type to the rotary press, " * 4
    usages = [stream_completion(url, model, prompt, 8) for _ in range(2)]  # the second hits the cache
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = assert_vllm_copies_ours(text)
    labels = (("model_name", model),)
    assert samples[("vllm:prompt_tokens_total", labels)] == sum(u["prompt_tokens"] for u in usages)
    assert samples[("vllm:generation_tokens_total", labels)] == sum(u["completion_tokens"] for u in usages)
    assert samples[("vllm:e2e_request_latency_seconds_count", labels)] == 2
    assert samples[("vllm:prefix_cache_hits_total", labels)] > 0
    assert samples[("vllm:num_requests_running", labels)] == 0
