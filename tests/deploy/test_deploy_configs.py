"""The deployment files parse and are wired together: compose services, Prometheus scrape
target, Grafana provisioning, one dashboard panel per metric family, and the Dockerfile's
targets. (The images themselves: test_container.py, opt-in.)"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from urllib.parse import urlparse

import pytest

from server.observability import METRIC_FAMILIES

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DAEMON = "paged-serve"  # the compose service name
DAEMON_PORT = 8000  # where the daemon listens inside its container


def load_yaml(path: str | Path) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml("docker-compose.yml")


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return load_yaml("configs/prometheus.yml")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((ROOT / "configs/grafana/dashboards/paged-serve.json").read_text())


def mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts as {container path: host path}, checking each host path exists."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            host = (ROOT / source).resolve()
            assert host.exists(), f"{volume}: {host} does not exist"
            out[target] = host
    return out


def container_ports(service: dict) -> set[int]:
    return {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}


# --- docker-compose.yml --------------------------------------------------------------------

def test_compose_has_the_daemon_prometheus_and_grafana(compose):
    assert set(compose["services"]) >= {DAEMON, "prometheus", "grafana"}


def test_daemon_is_built_here_and_listens_on_its_port(compose):
    daemon = compose["services"][DAEMON]
    assert daemon["build"]["context"] == "."
    assert "cpu" in daemon["build"]["target"]
    assert DAEMON_PORT in container_ports(daemon)
    assert str(daemon["environment"]["PAGED_SERVE_PORT"]) == str(DAEMON_PORT)
    # Published on loopback only.
    assert all(str(p).startswith("127.0.0.1:") for p in daemon["ports"])


def test_daemon_healthcheck_probes_health(compose):
    check = compose["services"][DAEMON]["healthcheck"]
    probe = " ".join(check["test"])
    assert f"127.0.0.1:{DAEMON_PORT}/health" in probe
    assert check["start_period"]


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_daemon_health_gates_the_others(compose, service):
    depends = compose["services"][service]["depends_on"]
    assert depends[DAEMON]["condition"] == "service_healthy"


def test_prometheus_service_mounts_the_config_it_is_told_to_read(compose):
    service = compose["services"]["prometheus"]
    config_flag = next(a for a in service["command"] if a.startswith("--config.file="))
    target = config_flag.split("=", 1)[1]
    assert mounts(service)[target] == (ROOT / "configs/prometheus.yml").resolve()


# --- configs/prometheus.yml ----------------------------------------------------------------

def test_prometheus_scrapes_the_daemon_metrics(prometheus, compose):
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    job = jobs["paged-serve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"{DAEMON}:{DAEMON_PORT}"]
    host = targets[0].split(":")[0]
    assert host in compose["services"]


# --- Grafana provisioning ------------------------------------------------------------------

def test_grafana_datasource_points_at_the_prometheus_service(compose):
    grafana = compose["services"]["grafana"]
    provisioning = next(host for target, host in mounts(grafana).items()
                        if target == "/etc/grafana/provisioning")
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    source = datasources["datasources"][0]
    assert source["type"] == "prometheus"
    url = urlparse(source["url"])
    assert url.hostname == "prometheus" and url.hostname in compose["services"]
    assert url.port in container_ports(compose["services"]["prometheus"])


def test_grafana_dashboard_provider_reads_the_mounted_dashboards(compose):
    grafana = compose["services"]["grafana"]
    volumes = mounts(grafana)
    providers = yaml.safe_load(
        (volumes["/etc/grafana/provisioning"] / "dashboards" / "paged-serve.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert volumes[path] == (ROOT / "configs/grafana/dashboards").resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/paged-serve.json"


def panel_exprs(dashboard: dict) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p.get("targets", [])]
            for p in dashboard["panels"] if p["type"] != "row"}


@pytest.mark.parametrize("family", METRIC_FAMILIES)
def test_every_metric_family_has_a_panel(dashboard, family):
    # A family must be named as a whole (not just a prefix of a longer name).
    pattern = re.compile(re.escape(family) + r"(_bucket|_sum|_count)?(?![A-Za-z0-9_:])")
    panels = [title for title, exprs in panel_exprs(dashboard).items()
              if any(pattern.search(e) for e in exprs)]
    assert panels, f"no Grafana panel queries {family}"


def test_dashboard_queries_only_exported_families(dashboard):
    exported = set(METRIC_FAMILIES)
    for title, exprs in panel_exprs(dashboard).items():
        for expr in exprs:
            for name in re.findall(r"paged_serve:[A-Za-z0-9_]+", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in exported or base in exported, f"{title}: unknown metric {name}"


def test_dashboard_panels_use_the_provisioned_datasource(dashboard):
    datasources = load_yaml("configs/grafana/provisioning/datasources/prometheus.yml")
    uid = datasources["datasources"][0]["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]


def test_dashboard_json_is_what_the_generator_writes():
    generator = runpy.run_path(str(ROOT / "configs/grafana/generate_dashboard.py"))
    committed = (ROOT / "configs/grafana/dashboards/paged-serve.json").read_text()
    assert committed == generator["render"](), "run: python configs/grafana/generate_dashboard.py"


def test_dashboard_panels_do_not_overlap(dashboard):
    taken = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert pos["x"] + pos["w"] <= 24
        assert not cells & taken, panel["title"]
        taken |= cells


# --- Dockerfile ----------------------------------------------------------------------------

def stages(dockerfile: str) -> dict[str, list[str]]:
    """{stage name: its instructions (continuation lines joined)}."""
    text = re.sub(r"\\\n", " ", dockerfile)
    out, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = match.group(2) or match.group(1)
            out[current] = [line]
        elif current:
            out[current].append(line)
    return out


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[str]]:
    return stages((ROOT / "Dockerfile").read_text())


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dockerfile_final_stages(dockerfile, target):
    lines = dockerfile[target]
    text = "\n".join(lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    assert re.search(r"^HEALTHCHECK .*/health", text, re.MULTILINE)
    cmd = next(line for line in lines if line.startswith("CMD "))
    assert "paged-serve" in cmd and "--host 0.0.0.0" in cmd and "--port" in cmd
    assert "EXPOSE 8000" in lines


def test_dockerfile_bases(dockerfile):
    assert dockerfile["cpu-deps"][0].startswith("FROM ${PYTHON_IMAGE}")
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in (ROOT / "Dockerfile").read_text()
    assert "nvidia/cuda" in dockerfile["cuda-builder"][0] and "devel" in dockerfile["cuda-builder"][0]
    assert any("build.load('cuda')" in line for line in dockerfile["cuda-builder"])
    # The default model is served as stored: its tokenizer is converted at build time.
    for target in ("cpu", "cuda"):
        assert any("gguf_tokenizer_dir(default_gguf_path())" in line for line in dockerfile[target])


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for name in (".git", ".venv", "**/__pycache__"):
        assert name in ignored


def test_compose_flags_are_flags_the_daemon_knows(compose):
    """The daemon's default PAGED_SERVE_ARGS parse with the real CLI, plus the image's CMD flags."""
    import shlex

    from server.cli import build_parser

    value = compose["services"][DAEMON]["environment"]["PAGED_SERVE_ARGS"]
    default = re.fullmatch(r"\$\{PAGED_SERVE_ARGS:-(.*)\}", value).group(1)
    args = build_parser().parse_args(
        ["--host", "0.0.0.0", "--port", str(DAEMON_PORT), *shlex.split(default)])
    assert args.port == DAEMON_PORT
    # An API key must not lock Prometheus out of /metrics.
    assert args.metrics_public


# --- docker-compose.replicas.yml -----------------------------------------------------------

def test_replicas_sit_behind_the_balancer():
    replicas = load_yaml("docker-compose.replicas.yml")["services"]
    daemons = [name for name in replicas if name.startswith(DAEMON)]
    assert len(daemons) >= 2
    balancer = replicas["balancer"]
    nginx = balancer["build"]["dockerfile_inline"]
    for name in daemons:
        assert f"server {name}:{DAEMON_PORT}" in nginx
        assert balancer["depends_on"][name]["condition"] == "service_healthy"
        assert f"127.0.0.1:{DAEMON_PORT}/health" in " ".join(replicas[name]["healthcheck"]["test"])
    assert "proxy_buffering off" in nginx  # SSE passes through unbuffered
    assert DAEMON_PORT in container_ports(balancer)
    assert all(str(p).startswith("127.0.0.1:") for p in balancer["ports"])
    assert balancer["profiles"] == ["nginx"]  # the simple option; the router is the default front


def test_the_router_fronts_the_replicas_with_the_cache_aware_policy():
    replicas = load_yaml("docker-compose.replicas.yml")["services"]
    daemons = [name for name in replicas if name.startswith(DAEMON)]
    router = replicas["router"]
    assert "profiles" not in router  # up by default
    command = router["command"]
    assert command[:2] == ["sglang-router", "launch"]
    assert command[command.index("--policy") + 1] == "${PAGED_SERVE_ROUTER_POLICY:-cache_aware}"
    workers = command[command.index("--worker-urls") + 1:]
    assert workers == [f"http://{name}:{DAEMON_PORT}" for name in daemons]
    assert command[command.index("--port") + 1] == str(DAEMON_PORT)
    assert "sglang-router==" in router["build"]["dockerfile_inline"]  # pinned: the routes it reads
    for name in daemons:
        assert router["depends_on"][name]["condition"] == "service_healthy"
    assert DAEMON_PORT in container_ports(router)
    assert all(str(p).startswith("127.0.0.1:") for p in router["ports"])
    # The router and nginx publish on different host ports, so both can run.
    assert router["ports"][0].split(":")[1] != replicas["balancer"]["ports"][0].split(":")[1]
