"""The stand-in metrics used only when server.observability cannot be imported."""

from __future__ import annotations

from engine.loop.metrics import EngineStats
from server.app import make_metrics
from server.metrics_fallback import FallbackMetrics


def test_fallback_has_the_same_interface():
    m = FallbackMetrics("m", {"block_size": "16"})
    m.observe(EngineStats(num_running=2, num_device_blocks=10, num_free_device_blocks=4, kv_cache_usage=0.6))
    m.client_disconnected()
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert 'paged_serve:num_requests_running{model_name="m"} 2.0' in text
    assert 'paged_serve:kv_blocks_free{model_name="m"} 4.0' in text
    assert 'paged_serve:client_disconnects_total{model_name="m"} 1.0' in text


def test_make_metrics_prefers_the_observability_module():
    m = make_metrics("m", {"block_size": "16", "num_gpu_blocks": "10"})
    assert type(m).__module__ in ("server.observability", "server.metrics_fallback")
    body, _ = m.render()
    assert b"paged_serve:kv_cache_usage_perc" in body
