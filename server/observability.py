"""Prometheus metrics for the daemon, fed from the engine's per-step `EngineStats`.

The engine loop calls `Metrics.observe(stats)` after every step (from the engine thread); the
HTTP server calls `Metrics.render()` for GET /metrics. Names follow vLLM's where the meaning is
the same, under our own `paged_serve:` prefix, and every sample carries a `model_name` label.

How each kind of field in `EngineStats` becomes a metric:
- gauges are set from the snapshot (the state after the step);
- counters advance by the difference between this snapshot's cumulative `*_total` and the
  previous one's, so Prometheus counters and the engine's totals always agree;
- histograms are fed from the step's events (this step's TTFTs, inter-token latencies,
  iteration size, and the requests that finished in it).

Each `Metrics` has its own `CollectorRegistry`, so several servers can live in one process
(tests do this) without clashing in the global registry.
"""

from __future__ import annotations

import re
import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from engine.loop.metrics import EngineStats
from server.metrics_compat import COMPAT_MODES, VllmCompatCollector

PREFIX = "paged_serve:"

# Every metric family we export, as it appears in the exposition text (counters gain `_total`,
# the info metric gains `_info`). Tests and the Grafana dashboard check against this list.
GAUGES = [
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "kv_cache_usage_perc",
    "cpu_cache_usage_perc",
    "kv_blocks_total",
    "kv_blocks_free",
    "kv_internal_fragmentation",
    "kv_shared_blocks",
    "kv_blocks_saved_by_sharing",
    "engine_seconds_without_progress",
]
COUNTERS = [
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "client_disconnects",
    "swap_in_bytes",
    "swap_out_bytes",
    "engine_stalls",
]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "iteration_tokens",
    "request_prompt_tokens",
    "request_generation_tokens",
]
INFOS = ["cache_config"]

METRIC_FAMILIES: list[str] = (
    [PREFIX + name for name in GAUGES]
    + [PREFIX + name + "_total" for name in COUNTERS]
    + [PREFIX + name for name in HISTOGRAMS]
    + [PREFIX + name + "_info" for name in INFOS]
)

PREEMPTION_MODES = ("swap", "recompute")
# NOTE: created up front so that request_success reads 0 for each reason before any request ends.
FINISH_REASONS = ("stop", "length", "abort")

# Bucket edges, after vLLM's where there is one.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# 1, 2, 5, 10, 20, 50, ... up to 100k tokens.
TOKEN_BUCKETS = [float(m * 10**e) for e in range(6) for m in (1, 2, 5) if m * 10**e <= 100_000]


class Metrics:
    """All of the daemon's Prometheus metrics for one model, in a registry of their own."""

    def __init__(self, model_name: str, cache_info: dict[str, str], compat: str | None = None):
        """`cache_info` becomes the labels of `paged_serve:cache_config_info` (e.g. block_size,
        num_gpu_blocks, num_cpu_blocks, cache_dtype, preemption_mode); keys that are not valid
        label names are rewritten with underscores. Its num_gpu_blocks, when given, sets
        kv_blocks_total and kv_blocks_free until the first observe(). `compat` "vllm"
        (--metrics-compat) also exports the families vLLM has under vLLM's names
        (server/metrics_compat.py); None exports ours alone."""
        if compat is not None and compat not in COMPAT_MODES:
            raise ValueError(f"unknown metrics compat {compat!r}; expected one of {COMPAT_MODES}")
        # NOTE: drops the `*_created` timestamp series prometheus_client adds beside every counter
        # and histogram (as vLLM does); they double the exposition and no dashboard reads them.
        # The switch is process-wide, which is fine in a process that only serves.
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        # The cumulative totals seen at the previous observe(), to turn them into increments.
        self._prev: dict[str, int] = {}
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        # Gauges: the state after the latest step.
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to the CPU pool.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction (0..1) of device KV blocks in use.")
        self.cpu_cache_usage_perc = gauge(
            "cpu_cache_usage_perc", "Fraction (0..1) of CPU swap-pool KV blocks in use.")
        self.kv_blocks_total = gauge("kv_blocks_total", "Blocks in the device KV pool.")
        self.kv_blocks_free = gauge("kv_blocks_free", "Free blocks in the device KV pool.")
        self.kv_internal_fragmentation = gauge(
            "kv_internal_fragmentation",
            "Allocated token slots that hold no token, as a fraction (0..1) of allocated slots.")
        self.kv_shared_blocks = gauge(
            "kv_shared_blocks", "Device blocks with a reference count above 1.")
        self.kv_blocks_saved_by_sharing = gauge(
            "kv_blocks_saved_by_sharing",
            "Blocks that sharing saves: the sum over blocks of (reference count - 1).")
        self.engine_seconds_without_progress = gauge(
            "engine_seconds_without_progress",
            "Seconds the engine has had work pending without finishing a step (0 when idle); "
            "past --engine-stall-timeout it is stalled and /health answers 503.")

        # Counters.
        self._num_preemptions = Counter(
            PREFIX + "num_preemptions", "Preempted sequence groups, by preemption mode.",
            labels + ["mode"], registry=self.registry)
        self._request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        for mode in PREEMPTION_MODES:
            self._num_preemptions.labels(model_name, mode)
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefilled).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.client_disconnects = counter(
            "client_disconnects", "Requests aborted because the client went away.")
        self.swap_in_bytes = counter("swap_in_bytes", "KV cache bytes copied from CPU to device.")
        self.swap_out_bytes = counter("swap_out_bytes", "KV cache bytes copied from device to CPU.")
        self.engine_stalls = counter(
            "engine_stalls", "Times the engine stalled (work pending, no step for --engine-stall-timeout).")

        # Histograms.
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two consecutive generated tokens.",
            ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the end of a finished request.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first being scheduled.",
            REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens processed by one engine step.", TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS)

        Info(PREFIX + "cache_config", "KV cache configuration.", labels,
             registry=self.registry).labels(model_name).info(_label_dict(cache_info))
        # The pool's size is known before the first step: an idle server already exports it.
        num_blocks = str(cache_info.get("num_gpu_blocks", ""))
        if num_blocks.isdigit():
            self.kv_blocks_total.set(int(num_blocks))
            self.kv_blocks_free.set(int(num_blocks))
        # NOTE: a registry of its own, since the collector reads self.registry at each scrape.
        self.compat_registry: CollectorRegistry | None = None
        if compat == "vllm":
            self.compat_registry = CollectorRegistry(auto_describe=False)
            self.compat_registry.register(VllmCompatCollector(self.registry, PREFIX))

    def observe(self, stats: EngineStats) -> None:
        """Record one engine step. Thread-safe; called from the engine thread after each step.

        Mutates the gauges (set), counters (increased by the change in each cumulative total
        since the previous call) and histograms (one observation per event in the step)."""
        with self._lock:
            self.num_requests_running.set(stats.num_running)
            self.num_requests_waiting.set(stats.num_waiting)
            self.num_requests_swapped.set(stats.num_swapped)
            self.kv_cache_usage_perc.set(stats.kv_cache_usage)
            self.cpu_cache_usage_perc.set(stats.cpu_cache_usage)
            self.kv_blocks_total.set(stats.num_device_blocks)
            self.kv_blocks_free.set(stats.num_free_device_blocks)
            self.kv_internal_fragmentation.set(stats.kv_internal_fragmentation)
            self.kv_shared_blocks.set(stats.num_shared_blocks)
            self.kv_blocks_saved_by_sharing.set(stats.num_blocks_saved_by_sharing)

            self._advance("prompt_tokens", stats.prompt_tokens_total, self.prompt_tokens)
            self._advance("generation_tokens", stats.generation_tokens_total, self.generation_tokens)
            self._advance("prefix_cache_queries", stats.prefix_cache_queries_total,
                          self.prefix_cache_queries)
            self._advance("prefix_cache_hits", stats.prefix_cache_hits_total, self.prefix_cache_hits)
            self._advance("swap_in_bytes", stats.swap_in_bytes_total, self.swap_in_bytes)
            self._advance("swap_out_bytes", stats.swap_out_bytes_total, self.swap_out_bytes)
            for mode, total in stats.num_preemptions_total.items():
                self._advance(f"num_preemptions/{mode}", total,
                              self._num_preemptions.labels(self.model_name, mode))
            for reason, total in stats.request_success_total.items():
                self._advance(f"request_success/{reason}", total,
                              self._request_success.labels(self.model_name, reason))

            if stats.iteration_tokens > 0:
                self.iteration_tokens.observe(stats.iteration_tokens)
            for ttft in stats.time_to_first_tokens:
                self.time_to_first_token.observe(ttft)
            for itl in stats.inter_token_latencies:
                self.inter_token_latency.observe(itl)
            for request in stats.finished_requests:
                if request.e2e_latency is not None:
                    self.e2e_request_latency.observe(request.e2e_latency)
                if request.queue_time is not None:
                    self.request_queue_time.observe(request.queue_time)
                self.request_prompt_tokens.observe(request.num_prompt_tokens)
                self.request_generation_tokens.observe(request.num_generation_tokens)

    def observe_watchdog(self, seconds_without_progress: float, stalls_total: int) -> None:
        """Record the engine watchdog's state (called by the server before each scrape)."""
        with self._lock:
            self.engine_seconds_without_progress.set(seconds_without_progress)
            self._advance("engine_stalls", stalls_total, self.engine_stalls)

    def client_disconnected(self) -> None:
        """Count one request aborted because its client disconnected (called by the server)."""
        self.client_disconnects.inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, for GET /metrics."""
        with self._lock:  # a scrape never sees half of a step
            body = generate_latest(self.registry)
            if self.compat_registry is not None:
                body += generate_latest(self.compat_registry)
            return body, CONTENT_TYPE_LATEST

    def _advance(self, key: str, total: int, counter: Counter) -> None:
        """Increase `counter` by how much the cumulative `total` grew since the last call."""
        previous = self._prev.get(key, 0)
        # NOTE: a total below the previous one means the engine's counters restarted from 0
        # (a new engine behind the same server): everything it counted since is new.
        delta = total - previous if total >= previous else total
        if delta > 0:
            counter.inc(delta)
        self._prev[key] = total


def _label_dict(info: dict[str, str]) -> dict[str, str]:
    """`info` with keys made valid Prometheus label names and values made strings."""
    out = {}
    for key, value in info.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
        if not name or name[0].isdigit():
            name = "_" + name
        if name == "model_name":  # already a label of every metric
            continue
        out[name] = str(value)
    return out
