"""Writes configs/grafana/dashboards/paged-serve.json: one Grafana panel per metric family.

Run after adding a metric family to server/observability.py:
    python configs/grafana/generate_dashboard.py
tests/deploy checks that the committed JSON is what this script writes and that every family
the daemon exports has a panel.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "paged-serve.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
SEL = '{model_name=~"$model"}'
RATE = "[$__rate_interval]"

# (row title, [(panel title, kind, family, unit, extra)]); kind decides the queries:
#   gauge: the value; counter: per-second rate (by `extra` label when given);
#   histogram: p50 / p90 / p99 and the mean; info: a table of the labels.
ROWS = [
    ("Requests", [
        ("Running requests", "gauge", "paged_serve:num_requests_running", "short", None),
        ("Waiting requests", "gauge", "paged_serve:num_requests_waiting", "short", None),
        ("Swapped requests", "gauge", "paged_serve:num_requests_swapped", "short", None),
        ("Finished requests / s by reason", "counter", "paged_serve:request_success_total",
         "reqps", "finished_reason"),
        ("Preemptions / s by mode", "counter", "paged_serve:num_preemptions_total", "short", "mode"),
        ("Client disconnects / s", "counter", "paged_serve:client_disconnects_total", "short", None),
        ("Engine: seconds without progress", "gauge", "paged_serve:engine_seconds_without_progress", "s", None),
        ("Engine stalls / s", "counter", "paged_serve:engine_stalls_total", "short", None),
    ]),
    ("KV cache", [
        ("Device KV usage", "gauge", "paged_serve:kv_cache_usage_perc", "percentunit", None),
        ("CPU swap-pool usage", "gauge", "paged_serve:cpu_cache_usage_perc", "percentunit", None),
        ("KV blocks total", "gauge", "paged_serve:kv_blocks_total", "short", None),
        ("KV blocks free", "gauge", "paged_serve:kv_blocks_free", "short", None),
        ("Internal fragmentation", "gauge", "paged_serve:kv_internal_fragmentation",
         "percentunit", None),
        ("Shared blocks (ref count > 1)", "gauge", "paged_serve:kv_shared_blocks", "short", None),
        ("Blocks saved by sharing", "gauge", "paged_serve:kv_blocks_saved_by_sharing", "short", None),
        ("Swap in (bytes / s)", "counter", "paged_serve:swap_in_bytes_total", "Bps", None),
        ("Swap out (bytes / s)", "counter", "paged_serve:swap_out_bytes_total", "Bps", None),
        ("Prefix cache queries (tokens / s)", "counter", "paged_serve:prefix_cache_queries_total",
         "short", None),
        ("Prefix cache hits (tokens / s)", "counter", "paged_serve:prefix_cache_hits_total",
         "short", None),
        ("Cache configuration", "info", "paged_serve:cache_config_info", None, None),
    ]),
    ("Latency", [
        ("Time to first token", "histogram", "paged_serve:time_to_first_token_seconds", "s", None),
        ("Inter-token latency", "histogram", "paged_serve:inter_token_latency_seconds", "s", None),
        ("End-to-end request latency", "histogram", "paged_serve:e2e_request_latency_seconds",
         "s", None),
        ("Queue time", "histogram", "paged_serve:request_queue_time_seconds", "s", None),
    ]),
    ("Tokens", [
        ("Prompt tokens / s", "counter", "paged_serve:prompt_tokens_total", "short", None),
        ("Generated tokens / s", "counter", "paged_serve:generation_tokens_total", "short", None),
        ("Tokens per engine step", "histogram", "paged_serve:iteration_tokens", "short", None),
        ("Prompt length", "histogram", "paged_serve:request_prompt_tokens", "short", None),
        ("Generation length", "histogram", "paged_serve:request_generation_tokens", "short", None),
    ]),
]


def targets(kind: str, family: str, extra: str | None) -> list[dict]:
    def target(ref: str, expr: str, legend: str, **more) -> dict:
        return {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                **more}

    if kind == "gauge":
        return [target("A", f"{family}{SEL}", "{{model_name}}")]
    if kind == "counter":
        if extra:
            return [target("A", f"sum by ({extra}) (rate({family}{SEL}{RATE}))", f"{{{{{extra}}}}}")]
        return [target("A", f"sum(rate({family}{SEL}{RATE}))", "per second")]
    if kind == "histogram":
        quantiles = [
            target(ref, f"histogram_quantile({q}, sum by (le) (rate({family}_bucket{SEL}{RATE})))",
                   f"p{int(q * 100)}")
            for ref, q in (("A", 0.5), ("B", 0.9), ("C", 0.99))
        ]
        mean = target("D", f"sum(rate({family}_sum{SEL}{RATE})) / sum(rate({family}_count{SEL}{RATE}))",
                      "mean")
        return quantiles + [mean]
    if kind == "info":
        return [target("A", f"{family}{SEL}", "", format="table", instant=True)]
    raise ValueError(kind)


def panel(panel_id: int, title: str, kind: str, family: str, unit: str | None, extra, x, y) -> dict:
    common = {"id": panel_id, "title": title, "datasource": DATASOURCE,
              "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
              "description": f"{family} ({kind})", "targets": targets(kind, family, extra)}
    if kind == "info":
        return {**common, "type": "table",
                "transformations": [{"id": "labelsToFields"},
                                    {"id": "organize", "options": {"excludeByName": {
                                        "Time": True, "Value": True, "__name__": True}}}]}
    return {**common, "type": "timeseries",
            "fieldConfig": {"defaults": {"unit": unit, "min": 0,
                                         "custom": {"lineWidth": 2, "fillOpacity": 10}},
                            "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}}}


def dashboard() -> dict:
    panels, panel_id, y = [], 1, 0
    for row_title, specs in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, (title, kind, family, unit, extra) in enumerate(specs):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append(panel(panel_id, title, kind, family, unit, extra, x, y))
            panel_id += 1
        y += 8
    return {
        "uid": "paged-serve",
        "title": "paged-serve",
        "description": "paged-serve daemon: requests, KV block pool, latency and tokens.",
        "tags": ["paged-serve", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
            "query": {"query": "label_values(paged_serve:num_requests_running, model_name)",
                      "refId": "model"},
            "definition": "label_values(paged_serve:num_requests_running, model_name)",
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
        }]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
