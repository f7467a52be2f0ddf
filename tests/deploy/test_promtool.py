"""Prometheus's own checker on our files: the scrape config, and every Grafana panel query as
PromQL (each becomes a recording rule for `promtool check rules`). Skips without promtool
(Debian: apt-get install prometheus)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="no promtool: apt-get install prometheus")


def grafana_to_promql(expr: str) -> str:
    """A panel query with Grafana's variables replaced by what they expand to."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*")


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "configs/grafana/dashboards/paged-serve.json").read_text())
    return [(p["title"], grafana_to_promql(t["expr"]))
            for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_prometheus_config_passes_promtool():
    result = subprocess.run([PROMTOOL, "check", "config", str(ROOT / "configs/prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_panel_query_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "grafana-panels", "rules": [
        {"record": f"panel:query_{i}", "expr": expr} for i, (_, expr) in enumerate(panel_queries())
    ]}]}
    path = tmp_path / "panels.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
