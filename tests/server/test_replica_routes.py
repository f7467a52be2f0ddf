"""What routers and orchestrators ask a replica (server/routes/replica.py): /livez through the
engine's life (loading, ready, draining, dead), SGLang's /server_info, /model_info, /get_load,
and a request for a model this replica does not serve (a 404 a router can pass on)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
from fastapi.testclient import TestClient

from server.app import create_app
from server.cli import parse_args
from tests.server.conftest import FAULTY, start_server
from tests.server.faulty_engine import SLOW
from tests.server.support import assert_error, post

MODEL = "SmolLM2-135M-Instruct"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--seed", "0", "--log-level", "warning",
         "--disable-uvicorn-access-log"]
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_livez_stays_200_while_loading_and_turns_503_when_the_engine_died():
    """In process, with engines that never load: one blocks (loading), one raises (dead)."""
    release = threading.Event()

    def loading():
        release.wait(30)
        raise RuntimeError("not this test's concern")

    settings = parse_args(["--api-key", KEY]).settings
    with TestClient(create_app(settings, loading)) as client:
        live = client.get("/livez")  # open without the key: the kubelet sends none
        assert live.status_code == 200 and live.json() == {"status": "alive", "engine": "loading"}
        assert client.get("/health").status_code == 503
        assert_error(client.get("/server_info", headers=AUTH), 503)
        assert_error(client.get("/server_info"), 401)
        release.set()
        wait_for(lambda: client.get("/livez").status_code == 503)
        assert client.get("/livez").json()["status"] == "dead"


def test_router_routes_on_a_real_replica_and_livez_while_draining():
    server = start_server("--engine-factory", FAULTY, *SMALL, "--shutdown-timeout", "5")
    try:
        info = httpx.get(server.url + "/server_info").json()
        assert info["served_model_name"] == MODEL and info["dp_size"] == 1
        assert info["max_model_len"] == 512 and info["page_size"] == 16
        assert info["max_total_tokens"] > 0 and info["max_total_tokens"] % 16 == 0
        assert "model_path" not in info  # the gateway would try to load a tokenizer from it
        assert httpx.get(server.url + "/get_server_info").json() == info
        model = httpx.get(server.url + "/model_info").json()
        assert model == {"served_model_name": MODEL, "is_generation": True, "max_model_len": 512}
        assert httpx.get(server.url + "/get_model_info").json() == model
        assert httpx.get(server.url + "/get_load").json() == [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

        # A router that sends another model's request gets a clear 404 at once.
        start = time.monotonic()
        err = assert_error(post(server, "/v1/completions", {"model": "other", "prompt": "hi", "max_tokens": 2}),
                           404, param="model")
        assert err["code"] == "model_not_found" and time.monotonic() - start < 5
        assert_error(post(server, "/v1/chat/completions",
                          {"model": "other", "messages": [{"role": "user", "content": "hi"}]}), 404, "model")

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                slow = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"{SLOW} Once upon a time", "max_tokens": 400, "ignore_eos": True}))
                while (await client.get("/get_load")).json()[0]["num_tokens"] == 0:
                    await asyncio.sleep(0.05)
                load = (await client.get("/get_load")).json()[0]
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                health, live = await client.get("/health"), await client.get("/livez")
                return load, health, live, await slow

        load, health, live, slow = asyncio.run(run())
        assert load["num_reqs"] == 1 and load["num_tokens"] % 16 == 0
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert live.status_code == 200 and live.json()["engine"] == "ready"  # no restart mid-drain
        assert_error(slow, 503)  # outlived --shutdown-timeout
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
