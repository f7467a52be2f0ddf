"""The Kubernetes manifests under deploy/kubernetes/, checked offline (no cluster runs here).

Core kinds (Deployment, Service, RBAC) are validated strictly against Kubernetes' own OpenAPI
schemas, bundled by the `kubernetes-validate` package, for the oldest and newest versions it
knows. The custom resources (InferencePool, HTTPRoute, PodMonitor) have no bundled schema: they
get a structural check against their published CRD fields. Then the wiring: probes on the
routes that mean readiness and liveness, a grace period covering --shutdown-timeout, memory
requests covering the model and its pools, and every selector and reference resolving.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from engine.core.config import parse_size
from engine.worker.models.loader import default_gguf_path
from server.cli import build_parser

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
CUSTOM = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
          ("monitoring.coreos.com/v1", "PodMonitor")}
# Python, torch, the compiled ops and the server beside the weights and the KV pools.
RUNTIME_ALLOWANCE = 512 * 2**20


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def find(kind: str, name: str, file: str | None = None) -> dict:
    for manifest in [file] if file else MANIFESTS:
        for doc in documents(manifest):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name}")


def versions() -> list[str]:
    known = sorted(set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [known[0], known[-1]]


@pytest.fixture(scope="module")
def server() -> dict:
    return find("Deployment", "paged-serve", "paged-serve.yaml")


@pytest.fixture(scope="module")
def container(server) -> dict:
    (container,) = server["spec"]["template"]["spec"]["containers"]
    return container


def daemon_args(container: dict):
    """The container's PAGED_SERVE_ARGS parsed by the daemon's own CLI (as the image's CMD runs it)."""
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = int(env["PAGED_SERVE_PORT"])
    flags = shlex.split(env["PAGED_SERVE_ARGS"])
    return build_parser().parse_args(["--host", "0.0.0.0", "--port", str(port), *flags])


def quantity(value: str) -> int:
    """Bytes of a Kubernetes memory quantity ('2Gi', '512Mi', '3G')."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(value)).groups()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if unit and unit.endswith("i") else 1000
    return int(float(number) * base ** powers[unit[0]]) if unit else int(number)


# --- schemas -------------------------------------------------------------------------------

@pytest.mark.parametrize("manifest", MANIFESTS)
@pytest.mark.parametrize("version", versions())
def test_core_kinds_match_the_kubernetes_schemas(manifest, version):
    for doc in documents(manifest):
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelt_field(container, server):
    import copy

    broken = copy.deepcopy(server)
    probe = broken["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, versions()[-1], strict=True)


def test_kustomization_lists_files_that_exist():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["resources"] and all((K8S / r).is_file() for r in kustomization["resources"])


# --- the daemon's Deployment ---------------------------------------------------------------

def test_readiness_is_health_and_liveness_is_livez(container):
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    # NOTE: /health is 503 while loading and draining: as liveness it would restart those pods.
    assert ready["path"] == "/health" and live["path"] == "/livez"
    assert ready["port"] in port_names and live["port"] in port_names


def test_the_daemon_flags_parse_and_listen_on_the_container_port(container):
    args = daemon_args(container)
    assert args.port == container["ports"][0]["containerPort"]
    assert args.metrics_compat == "vllm"  # the endpoint picker's names
    assert args.metrics_public  # an API key must not lock the scrapers out


def test_the_grace_period_covers_the_drain(server, container):
    args = daemon_args(container)
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    grace = server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= int(pause[1]) + args.shutdown_timeout + 5


def test_memory_requests_cover_the_model_and_its_pools(container):
    args = daemon_args(container)
    needed = (default_gguf_path().stat().st_size + parse_size(args.kv_cache_memory)
              + int(float(args.swap_space) * 2**30) + RUNTIME_ALLOWANCE)
    resources = container["resources"]
    assert quantity(resources["requests"]["memory"]) >= needed
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])
    assert "cpu" in resources["requests"]


def test_the_service_and_scrape_annotations_reach_the_pods(server, container):
    pod = server["spec"]["template"]
    service = find("Service", "paged-serve", "paged-serve.yaml")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert server["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in names for p in service["spec"]["ports"])
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == container["ports"][0]["containerPort"]


# --- custom resources: their CRDs' fields ------------------------------------------------

def test_podmonitor_selects_the_pods_and_scrapes_metrics(server, container):
    monitor = find("PodMonitor", "paged-serve", "podmonitor.yaml")
    assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]} and endpoint["path"] == "/metrics"


def test_inference_pool_follows_its_crd_and_points_at_the_pods_and_the_picker(server, container):
    pool = find("InferencePool", "paged-serve", "inference-pool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}  # all required, nothing else
    assert set(spec["selector"]) == {"matchLabels"}
    assert spec["selector"]["matchLabels"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    assert len(spec["targetPorts"]) == 1 and set(spec["targetPorts"][0]) == {"number"}  # maxItems 1
    assert spec["targetPorts"][0]["number"] == container["ports"][0]["containerPort"]
    picker = spec["endpointPickerRef"]
    assert set(picker) <= {"group", "kind", "name", "port", "failureMode"}
    assert picker.get("kind", "Service") == "Service" and picker["failureMode"] in ("FailOpen", "FailClose")
    assert set(picker["port"]) == {"number"}  # required when the kind is Service
    service = find("Service", picker["name"], "inference-pool.yaml")
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    epp = find("Deployment", picker["name"], "inference-pool.yaml")
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    # The metrics the picker reads by default are exported (--metrics-compat vllm), but for LoRA's.
    assert "--lora-info-metric=" in args
    assert not [a for a in args if a.startswith("--") and a.endswith("-metric")]


def test_httproute_sends_to_the_pool():
    route = find("HTTPRoute", "paged-serve", "inference-pool.yaml")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    find("InferencePool", backend["name"], "inference-pool.yaml")


def test_the_picker_may_read_what_it_watches():
    binding = find("RoleBinding", "paged-serve-epp", "inference-pool.yaml")
    role = find("Role", binding["roleRef"]["name"], "inference-pool.yaml")
    epp = find("Deployment", "paged-serve-epp", "inference-pool.yaml")
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    readable = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= readable
