"""A minimal stand-in for `server.observability.Metrics`, used only if that module cannot be
imported: the same interface, a handful of gauges."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from engine.loop.metrics import EngineStats


class FallbackMetrics:
    def __init__(self, model_name: str, cache_info: dict[str, str], compat: str | None = None) -> None:
        # NOTE: `compat` (--metrics-compat) is not honoured: the fallback exports its own names only.
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"paged_serve:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.usage = gauge("kv_cache_usage_perc", "Used fraction of the device KV block pool.")
        self.total = gauge("kv_blocks_total", "KV blocks in the device pool.")
        self.free = gauge("kv_blocks_free", "Free KV blocks in the device pool.")
        self.disconnects = Counter("paged_serve:client_disconnects", "Clients that left mid-request.",
                                   list(labels), registry=self.registry).labels(**labels)

    def observe(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.usage.set(stats.kv_cache_usage)
        self.total.set(stats.num_device_blocks)
        self.free.set(stats.num_free_device_blocks)

    def observe_watchdog(self, seconds_without_progress: float, stalls_total: int) -> None:
        """Not exported by the fallback."""

    def client_disconnected(self) -> None:
        self.disconnects.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
