"""`--metrics-compat vllm`: the daemon's metrics also exported under vLLM's names.

Gateways and dashboards built for vLLM read fixed metric names: the Gateway API Inference
Extension's endpoint picker and the production-stack router read `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (older ones
`vllm:gpu_cache_usage_perc`), vLLM's Grafana dashboard reads its latency histograms and token
counters. `VllmCompatCollector` copies our families at scrape time under those names, so the
two sets can never disagree: same samples, same buckets, same `model_name` label.

Our families already follow vLLM's meaning (observability.py), so most are a rename of the
prefix. The exceptions are spelled out in `VLLM_NAMES` and `VLLM_ALIASES`:
- `num_preemptions` carries a `mode` label (swap / recompute) that vLLM's has not; the vLLM
  copy is summed over modes, so a `rate()` over it is one series as on vLLM;
- vLLM names the iteration-size histogram `iteration_tokens_total`;
- `gpu_cache_usage_perc` and `time_per_output_token_seconds` are the names vLLM used before
  `kv_cache_usage_perc` and `inter_token_latency_seconds`; older gateways and dashboards still
  query them, so both names are exported.
LoRA is not served, so there is no `vllm:lora_requests_info`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

VLLM_PREFIX = "vllm:"
COMPAT_MODES = ("vllm",)

# Our family name (without prefix, as prometheus_client names families: counters without
# `_total`) -> vLLM's. Families not listed here (our KV-pool detail, engine watchdog,
# client disconnects, swap bytes) have no vLLM counterpart and are not copied.
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "num_requests_swapped": "num_requests_swapped",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "cpu_cache_usage_perc": "cpu_cache_usage_perc",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "iteration_tokens": "iteration_tokens_total",
    "request_prompt_tokens": "request_prompt_tokens",
    "request_generation_tokens": "request_generation_tokens",
    "cache_config": "cache_config",
}
# vLLM family -> the older vLLM name also exported with the same samples.
VLLM_ALIASES = {
    "kv_cache_usage_perc": "gpu_cache_usage_perc",
    "inter_token_latency_seconds": "time_per_output_token_seconds",
}
# Labels of ours that vLLM's family has not: samples are summed over them.
DROPPED_LABELS = {"num_preemptions": ("mode",)}


class VllmCompatCollector(Collector):
    """Collects the families of `source` whose names start with `prefix`, renamed to vLLM's.

    Register it in a registry of its own (not `source`, which it reads), and render both."""

    def __init__(self, source: CollectorRegistry, prefix: str):
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(self.prefix):
                continue
            ours = family.name[len(self.prefix):]
            theirs = VLLM_NAMES.get(ours)
            if theirs is None:
                continue
            samples = _drop_labels(family.samples, DROPPED_LABELS.get(ours, ()))
            for name in (theirs, VLLM_ALIASES.get(theirs)):
                if name is not None:
                    yield _renamed(family, samples, VLLM_PREFIX + name)

    def describe(self) -> list[Metric]:
        # NOTE: nothing to describe up front: the families exist only once the source has them,
        # and an empty describe() keeps the registry from collecting at registration.
        return []


def _renamed(family: Metric, samples: list[Sample], name: str) -> Metric:
    """`family` with its name and every sample's name moved from `family.name` to `name`."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    for sample in samples:
        copy.samples.append(sample._replace(name=name + sample.name[len(family.name):]))
    return copy


def _drop_labels(samples: list[Sample], dropped: tuple[str, ...]) -> list[Sample]:
    """`samples` with the `dropped` labels removed and samples that then coincide summed."""
    if not dropped:
        return list(samples)
    merged: dict[tuple, Sample] = {}
    for sample in samples:
        labels = {k: v for k, v in sample.labels.items() if k not in dropped}
        key = (sample.name, tuple(sorted(labels.items())))
        previous = merged.get(key)
        value = sample.value + (previous.value if previous else 0.0)
        merged[key] = Sample(sample.name, labels, value, None, None)
    return list(merged.values())
