"""Several daemons behind one endpoint (docs/replicas.md): two replicas of the default model
behind nginx or HAProxy from Debian's packages, started here on loopback with a generated
config. Requests spread over the replicas; killing one mid-run costs only the requests it was
streaming, and everything after goes to the survivor.

Needs `apt-get install -y nginx-light haproxy` (either one is enough); skips without them.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, start_server, wait_for_health
from tests.server.support import wait_http_ok

FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "32MiB", "--swap-space", "0.02",
         "--max-num-seqs", "8", "--log-level", "warning", "--disable-uvicorn-access-log"]
MODEL = "SmolLM2-135M-Instruct"
BALANCERS = [b for b in ("nginx", "haproxy") if shutil.which(b)]

pytestmark = pytest.mark.skipif(
    not BALANCERS, reason="neither nginx nor haproxy is installed (apt-get install -y nginx-light haproxy)"
)


@pytest.fixture(scope="module")
def replicas():
    servers = [start_server(*FLAGS, wait_healthy=False) for _ in range(2)]
    try:
        for s in servers:
            wait_for_health(s, 180)
        yield servers
    finally:
        for s in servers:
            s.stop()


def nginx_config(port: int, upstreams: list[int], tmp: Path) -> str:
    """The balancer of docker-compose.replicas.yml, on loopback, plus an X-Upstream header."""
    servers = "\n".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;" for p in upstreams)
    temp = "\n".join(f"  {k}_temp_path {tmp}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
{temp}
  upstream paged_serve {{
    least_conn;
{servers}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://paged_serve;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
      proxy_next_upstream error http_502 http_503 non_idempotent;
      add_header X-Upstream $upstream_addr always;
    }}
  }}
}}
"""


def haproxy_config(port: int, upstreams: list[int], tmp: Path) -> str:
    servers = "\n".join(
        f"  server r{p} 127.0.0.1:{p} check inter 1s fall 1 rise 2" for p in upstreams
    )
    return f"""
global
  maxconn 256
defaults
  mode http
  timeout connect 2s
  timeout client 600s
  timeout server 600s
  retries 2
  option redispatch
  retry-on conn-failure empty-response 503
frontend api
  bind 127.0.0.1:{port}
  default_backend replicas
backend replicas
  balance leastconn
  option httpchk GET /health
  http-response set-header X-Upstream %[srv_name]
{servers}
"""


class Balancer:
    def __init__(self, kind: str, upstreams: list[int]):
        self.kind, self.port = kind, free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"paged-serve-{kind}-"))
        if kind == "nginx":
            for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
                (self.tmp / k).mkdir()
            conf = self.tmp / "nginx.conf"
            conf.write_text(nginx_config(self.port, upstreams, self.tmp))
            cmd = ["nginx", "-e", str(self.tmp / "error.log"), "-p", str(self.tmp), "-c", str(conf),
                   "-g", "daemon off;" + (" user root;" if _is_root() else "")]
        else:
            conf = self.tmp / "haproxy.cfg"
            conf.write_text(haproxy_config(self.port, upstreams, self.tmp))
            cmd = ["haproxy", "-f", str(conf), "-db"]
        self.log = open(self.tmp / "stdout.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        state = wait_http_ok(self.url + "/health", 20, self.proc)
        assert state != "exited", f"{kind} exited: {self.logs()}"
        if state == "ok":
            return
        raise RuntimeError(f"{kind} did not answer: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.tmp.glob("*.log"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _is_root() -> bool:
    import os

    return os.geteuid() == 0


def upstream_port(r: httpx.Response) -> int | None:
    """The replica that answered, from the balancer's X-Upstream header (an address or r<port>)."""
    m = re.search(r"(\d+)$", r.headers.get("x-upstream", ""))
    return int(m.group(1)) if m else None


def complete(url: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", BALANCERS)
def test_requests_spread_across_replicas(replicas, kind):
    ports = [s.port for s in replicas]
    balancer = Balancer(kind, ports)
    try:
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda _: complete(balancer.url), range(8)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        used = {upstream_port(r) for r in responses}
        assert used == set(ports), f"{kind} sent everything to {used}"
        texts = {r.json()["choices"][0]["text"] for r in responses}
        assert len(texts) == 1  # same model, same greedy answer from either replica
    finally:
        balancer.stop()


@pytest.mark.timeout(150)
def test_killing_a_replica_costs_only_its_in_flight_requests(replicas):
    """Six streams spread over both replicas; one replica is killed as soon as all six are
    answering: its streams break, the others finish, and every later request is answered by the
    survivor."""
    survivor, victim = replicas
    balancer = Balancer(BALANCERS[0], [survivor.port, victim.port])
    answering = threading.Semaphore(0)  # released once per stream, when its response began

    def stream(i: int) -> tuple[int | None, bool]:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True}
        upstream, done, released = None, False, False
        try:
            with httpx.stream("POST", balancer.url + "/v1/completions", json=body, timeout=90) as r:
                upstream = upstream_port(r)
                answering.release()
                released = True
                done = any(line.strip() == "data: [DONE]" for line in r.iter_lines())
        except httpx.HTTPError:
            pass
        finally:
            if not released:
                answering.release()  # NOTE: never leave the test waiting; the asserts catch it
        return upstream, done

    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, i) for i in range(6)]
            for _ in futures:
                assert answering.acquire(timeout=90)
            victim.stop(signal.SIGKILL)
            results = [f.result() for f in futures]
        on_victim = [done for up, done in results if up == victim.port]
        on_survivor = [done for up, done in results if up == survivor.port]
        assert on_victim and on_survivor, f"streams were not spread: {results}"
        assert all(on_survivor), f"a stream on the surviving replica failed: {results}"
        assert not any(on_victim), f"a stream on the killed replica finished: {results}"
        after = [complete(balancer.url) for _ in range(4)]
        assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
        assert {upstream_port(r) for r in after} == {survivor.port}
    finally:
        balancer.stop()
