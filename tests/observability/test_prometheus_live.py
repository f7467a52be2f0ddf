"""A real Prometheus (Debian's `prometheus`, on loopback) scrapes the real daemon with our
scrape config, and every Grafana panel query runs against what it stored. Skips without the
prometheus binary."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.observability.obs_support import REPO, free_port, stream_completion
from tests.server.support import wait_http_ok

yaml = pytest.importorskip("yaml")
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus: apt-get install prometheus")


@pytest.fixture
def prometheus(live_server, tmp_path):
    """Prometheus with configs/prometheus.yml, its target pointed at the live daemon."""
    config = yaml.safe_load((REPO / "configs/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    job = config["scrape_configs"][0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{live_server.port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_http_ok(f"{url}/-/ready", 60, proc, interval=0.5) != "ok":
            pytest.fail("prometheus did not start:\n" + (tmp_path / "prometheus.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def query(url: str, expr: str) -> list:
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert response["status"] == "success", (expr, response)
    return response["data"]["result"]


def wait_for(url: str, expr: str, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        result = query(url, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_prometheus_scrapes_the_daemon_and_every_panel_query_runs(live_server, prometheus):
    up = wait_for(prometheus, 'up{job="paged-serve"} == 1')
    assert up, "the daemon's /metrics was not scraped"
    # Some traffic, and two more scrapes, so that rate() has two points to work with.
    stream_completion(live_server.url, live_server.model(), "Prometheus is", 8)
    time.sleep(2.5)
    assert wait_for(prometheus, "paged_serve:generation_tokens_total > 0")
    assert wait_for(prometheus, "paged_serve:kv_blocks_total > 0")

    dashboard = json.loads((Path(REPO) / "configs/grafana/dashboards/paged-serve.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            query(prometheus, expr)  # asserts the query runs
        if panel["title"] in ("Running requests", "KV blocks total", "Cache configuration"):
            assert query(prometheus, panel["targets"][0]["expr"].replace("$model", ".*")), panel["title"]
