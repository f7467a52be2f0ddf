"""Build the CPU image with podman and serve one completion from it (opt-in: -m container).

Needs rootful podman (and podman-compose for the compose tests); scripts/container_base.sh makes
the base image `python:3.11-slim` available (pulled, or built from Debian where no registry is
reachable), so the image then builds with no pull and runs on loopback.
Slow (minutes: the first build downloads the Python dependencies): run it on its own,
    python -m pytest -m container tests/deploy -q
Where a CPU torch wheel lies in $PAGED_SERVE_TORCH_WHEELS (default /opt/wheels), the build
mounts that folder and installs torch from it instead of downloading a CUDA build from PyPI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.observability.obs_support import free_port
from server.observability import METRIC_FAMILIES

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE_SCRIPT = ROOT / "scripts" / "container_base.sh"
IMAGE = os.environ.get("PAGED_SERVE_IMAGE", "localhost/paged-serve:cpu")
WHEELS = Path(os.environ.get("PAGED_SERVE_TORCH_WHEELS", "/opt/wheels"))
HEALTH_TIMEOUT = 300.0


def run(*cmd: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def build_args() -> list[str]:
    if any(WHEELS.glob("torch-*+cpu-*.whl")):
        return ["-v", f"{WHEELS}:/wheels:ro", "--build-arg", "TORCH_FIND_LINKS=/wheels",
                "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    return []


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    run("bash", str(BASE_IMAGE_SCRIPT), timeout=900)
    if os.environ.get("PAGED_SERVE_SKIP_BUILD") != "1":
        # NOTE: --format docker: the OCI image format has no HEALTHCHECK and podman drops it.
        run("podman", "build", "--isolation", "chroot", "--pull=never", "--format", "docker",
            *build_args(),
            "-t", IMAGE, str(ROOT), timeout=3600)
    return IMAGE


@pytest.fixture(scope="module")
def container(image):
    name = f"paged-serve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    run("podman", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
        "-e", "PAGED_SERVE_ARGS=--kv-cache-memory 256MiB --max-model-len 2048",
        image, timeout=120)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while True:
            state = run("podman", "inspect", "-f", "{{.State.Status}}", name, timeout=30).stdout.strip()
            if state != "running":
                logs = run("podman", "logs", name, timeout=30, check=False)
                pytest.fail(f"container {state}:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = run("podman", "logs", name, timeout=30, check=False)
                pytest.fail(f"no /health 200 in {HEALTH_TIMEOUT} s:\n{logs.stderr[-4000:]}")
            time.sleep(2)
        yield name, url
    finally:
        run("podman", "rm", "-f", "-t", "1", name, timeout=120, check=False)


def test_the_image_serves_a_completion(container):
    _, url = container
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] > 0


def test_the_image_exports_metrics_and_the_dashboard(container):
    _, url = container
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for family in METRIC_FAMILIES:
        assert family in metrics
    page = httpx.get(f"{url}/dashboard", timeout=30)
    assert page.status_code == 200 and "KV block map" in page.text


def test_the_image_runs_as_non_root_and_is_healthy(container):
    name, _ = container
    uid = run("podman", "exec", name, "id", "-u", timeout=60).stdout.strip()
    assert uid != "0"
    # The image's HEALTHCHECK command itself passes (podman runs it on demand).
    assert run("podman", "healthcheck", "run", name, timeout=60, check=False).returncode == 0


def test_the_default_model_is_inside_the_image(container):
    """Served as stored from the package's GGUF, its tokenizer converted at build time."""
    name, url = container
    listing = run("podman", "exec", name, "ls", "/opt/paged-serve/models/gguf-tokenizer", timeout=60).stdout
    assert "SmolLM2-135M-Instruct" in listing
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_compose_brings_the_daemon_up_healthy(image):
    """podman-compose starts the compose file's daemon service from the built image, and the
    compose health check (the one that gates Prometheus and Grafana) reports healthy. The
    Prometheus and Grafana images cannot be pulled here; their configs are checked by parsing."""
    if shutil.which("podman-compose") is None:
        pytest.skip("no podman-compose (pip install podman-compose)")
    project, port, compose_run = compose_project("docker-compose.yml", "PAGED_SERVE_HOST_PORT")

    try:
        up = compose_run("up", "-d", "--no-build", "paged-serve")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        name = run("podman", "ps", "-q", "--filter", f"label=io.podman.compose.project={project}",
                   timeout=60).stdout.split()[0]
        deadline = time.monotonic() + HEALTH_TIMEOUT
        status = ""
        while time.monotonic() < deadline:
            # Without systemd timers podman runs health checks only on demand: run it as the
            # engine's scheduler would, then read the state that depends_on waits for.
            run("podman", "healthcheck", "run", name, timeout=60, check=False)
            status = run("podman", "inspect", "-f", "{{.State.Health.Status}}", name,
                         timeout=60).stdout.strip()
            if status == "healthy":
                break
            time.sleep(3)
        assert status == "healthy"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        compose_run("down", "-t", "1", timeout=300)


def compose_project(file: str, port_variable: str, profiles: tuple[str, ...] = ()):
    """A fresh compose project of `file` whose front listens on a free loopback port (set in
    `port_variable`), its daemons small: (project, port, compose_run)."""
    project = f"paged-serve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**os.environ, port_variable: str(port),
           "PAGED_SERVE_ARGS": "--kv-cache-memory 256MiB --max-model-len 2048 --metrics-public"}
    return project, port, compose_command(project, file, env, profiles)


def compose_command(project: str, file: str, env: dict, profiles: tuple[str, ...] = ()):
    compose = ["podman-compose", "-p", project, "-f", str(ROOT / file)]
    for profile in profiles:
        compose += ["--profile", profile]

    def compose_run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run([*compose, *args], capture_output=True, text=True,
                                timeout=timeout, env=env, cwd=ROOT)
        return result

    return compose_run


def wait_healthy(name: str) -> None:
    """Run the container's health check until it passes (no systemd timers run it here)."""
    deadline = time.monotonic() + HEALTH_TIMEOUT
    while time.monotonic() < deadline:
        if run("podman", "healthcheck", "run", name, timeout=60, check=False).returncode == 0:
            return
        time.sleep(3)
    pytest.fail(f"{name} never became healthy")


def replica_requests(name: str) -> float:
    """Finished requests counted by one replica, read from inside its container."""
    script = ("import urllib.request; t = urllib.request.urlopen('http://127.0.0.1:8000/metrics')"
              ".read().decode(); print(sum(float(l.split()[-1]) for l in t.splitlines()"
              " if l.startswith('paged_serve:request_success_total')))")
    return float(run("podman", "exec", name, "python", "-c", script, timeout=60).stdout)


def replicas_then_front(compose_run, project: str, front: str) -> dict[str, str]:
    """Start docker-compose.replicas.yml's two replicas, wait until they are healthy (what
    depends_on waits for), then build and start `front` (the balancer or the router). Returns
    the replicas' container names by service."""
    up = compose_run("up", "-d", "--no-build", "paged-serve-1", "paged-serve-2")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    names = {}
    for service in ("paged-serve-1", "paged-serve-2"):
        names[service] = run(
            "podman", "ps", "-q", "--filter", f"label=io.podman.compose.project={project}",
            "--filter", f"label=io.podman.compose.service={service}", timeout=60).stdout.split()[0]
        wait_healthy(names[service])
    build = compose_run("build", front, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    up = compose_run("up", "-d", "--no-deps", front)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    return names


def assert_streams(url: str, model: str, prompt: str) -> None:
    """A streamed completion through the front arrives as several events, then [DONE]."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_replicas_answer_through_the_balancer(image):
    """docker-compose.replicas.yml: two daemons behind nginx; requests reach both."""
    if shutil.which("podman-compose") is None:
        pytest.skip("no podman-compose (pip install podman-compose)")
    project, port, compose_run = compose_project("docker-compose.replicas.yml", "PAGED_SERVE_NGINX_PORT", profiles=("nginx",))
    try:
        names = replicas_then_front(compose_run, project, "balancer")

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "balancer never answered"
            time.sleep(1)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for i in range(6):
            response = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": f"Request number {i} says", "max_tokens": 4})
            assert response.status_code == 200, response.text
        # Streaming passes through the balancer chunk by chunk.
        assert_streams(url, model, "Streaming through nginx")
        counts = [replica_requests(name) for name in names.values()]
        assert sum(counts) == 7 and min(counts) >= 1, counts
    finally:
        compose_run("down", "-t", "1", timeout=300)


def test_replicas_answer_through_the_router(image):
    """docker-compose.replicas.yml's default front: sglang-router (cache-aware) before two
    daemons. It registers both (it lists the model), forwards chat and streams, and sends a
    conversation's next turn to the replica that holds its history (cached prompt tokens)."""
    if shutil.which("podman-compose") is None:
        pytest.skip("no podman-compose (pip install podman-compose)")
    project, port, compose_run = compose_project("docker-compose.replicas.yml", "PAGED_SERVE_HOST_PORT")
    try:
        names = replicas_then_front(compose_run, project, "router")

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        model = None
        while model is None:  # the router lists the model once it registered a replica
            try:
                listed = httpx.get(f"{url}/v1/models", timeout=5)
                if listed.status_code == 200 and listed.json().get("data"):
                    model = listed.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            assert model is not None or time.monotonic() < deadline, "the router never listed the model"
            time.sleep(1)
        messages = [{"role": "user", "content": "Tell me about the sea, the wind and the boats "
                     "that sail between the islands in the long summer evenings. " * 4}]
        for turn in range(3):
            response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
            assert response.status_code == 200, response.text
            body = response.json()
            if turn > 0:  # its history went to the same replica, whose prefix cache held it
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= body["usage"]["prompt_tokens"] // 2, body["usage"]
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And then, part {turn + 2}?"}]
        assert_streams(url, model, "Streaming through the router")
        counts = [replica_requests(name) for name in names.values()]
        assert sum(counts) == 4, counts
    finally:
        compose_run("down", "-t", "1", timeout=300)
