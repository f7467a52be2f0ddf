"""Reliability on the real engine (default model), with faults injected by
`tests.server.faulty_engine` (only prompts carrying a FAULT: marker misbehave):

- on the shared server: one failing request gets a 500 (or a final SSE error event) while the
  requests beside it complete;
- a "guarded" server with every limit flag and an API key (from the environment): loading 503,
  auth, CORS, a clear 400 per limit, 429 + Retry-After past --max-queued-requests;
- SIGTERM drain: requests in flight finish, new ones get 503, what is left at --shutdown-timeout
  ends with an error (SSE: a final error event), exit 0;
- a dead engine loop: /health 503, new requests 503, the log says why, SIGINT still exits 0;
  a load failure exits 1.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.server.conftest import FAULTY, start_server
from tests.server.faulty_engine import ERROR, FAIL, KILL, SLOW
from tests.server.support import assert_error, post, sse_events, wait_pool_free

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name (asked for before /v1/models answers)
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--seed", "0", "--log-level", "warning",
         "--disable-uvicorn-access-log"]


# ------------------------------------------------------------------ faults on the shared server
def test_request_failure_is_isolated(real_server):
    async def run():
        async with httpx.AsyncClient(base_url=real_server.url, timeout=120) as client:
            good = [client.post("/v1/completions", json={"model": MODEL, "prompt": f"Count to {i}:",
                                                         "max_tokens": 6, "ignore_eos": True}) for i in range(4)]
            bad = client.post("/v1/completions", json={"model": MODEL, "prompt": f"{FAIL} now", "max_tokens": 20})
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(run())
    err = assert_error(bad, 500)
    assert "injected failure in request" not in err["message"] and "injected failure in request" in real_server.log()
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in good)
    assert httpx.get(real_server.url + "/health").status_code == 200
    wait_pool_free(real_server.url)


def test_engine_reported_failure_is_a_500(real_server):
    """The engine's own isolation: a failure while appending this request's token."""
    err = assert_error(post(real_server, "/v1/completions",
                            {"model": MODEL, "prompt": f"{ERROR} here", "max_tokens": 5}), 500)
    assert "injected sampling failure" not in err["message"] and "injected sampling failure" in real_server.log()
    chat = post(real_server, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": f"say {ERROR}"}], "max_tokens": 3})
    assert "injected sampling failure" not in assert_error(chat, 500)["message"]
    assert post(real_server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200
    wait_pool_free(real_server.url)


def test_request_failure_while_streaming_is_an_error_event(real_server):
    events = sse_events(post(real_server, "/v1/completions",
                             {"model": MODEL, "prompt": f"{FAIL} stream", "max_tokens": 5, "stream": True}).text)
    assert "error" in events[-2] and events[-2]["error"]["type"] == "server_error"
    wait_pool_free(real_server.url)


# ------------------------------------------------------- a server with every limit and a key
KEY = "envkey"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT_FLAGS = ["--max-request-body-bytes", "1KiB", "--max-queued-requests", "2", "--max-n", "2",
               "--max-best-of", "3", "--max-prompts-per-request", "3", "--max-stop-sequences", "2",
               "--max-tokens-limit", "8", "--max-logprobs", "3"]


@pytest.fixture(scope="module")
def guarded():
    """Slow to load on purpose (3 s): what it answered while loading is kept in `.loading`."""
    server = start_server("--engine-factory", "tests.server.faulty_engine:build_slow", *SMALL, *LIMIT_FLAGS,
                          "--max-num-seqs", "3", "--metrics-public", "--allowed-origins", "http://example.com",
                          wait_healthy=False, env={"PAGED_SERVE_API_KEY": KEY})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(server.url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert server.proc.poll() is None, server.log()[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
        server.loading = (health, post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                       headers=AUTH))
        while httpx.get(server.url + "/health", timeout=5).status_code != 200:
            assert server.proc.poll() is None, server.log()[-3000:]
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_503_with_retry_after_while_loading(guarded):
    health, completion = guarded.loading
    assert health.status_code == 503 and health.json()["status"] == "loading"
    assert assert_error(completion, 503)["code"] == "model_loading"
    assert completion.headers["retry-after"] == "1"


def test_api_key_from_env_and_public_metrics(guarded):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(post(guarded, "/v1/completions", body), 401)
    assert_error(post(guarded, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
    assert post(guarded, "/v1/completions", body, headers=AUTH).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200  # --metrics-public
    assert httpx.get(guarded.url + "/kv/blocks").status_code == 200
    assert_error(httpx.get(guarded.url + "/kv/requests/gone"), 404)  # open too, and it has finished
    assert_error(httpx.get(guarded.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0).models.list().data


def test_api_key_flag_guards_metrics_unless_public():
    """The key from --api-key guards /metrics & co. too (no --metrics-public). The auth
    middleware answers before any route runs: this app's engine is never started."""
    from server.app import create_app
    from server.cli import parse_args

    def never_built():
        raise AssertionError("the engine must not be started by this test")

    app = create_app(parse_args(["--api-key", "sekret"]).settings, never_built)
    client = TestClient(app)  # NOTE: not as a context manager: the lifespan (engine start) never runs
    for path in ("/metrics", "/kv/blocks", "/kv/requests/cmpl-1-0", "/v1/models", "/version"):
        assert_error(client.get(path), 401)
        assert client.get(path, headers={"Authorization": "Bearer sekret"}).status_code != 401
    assert client.get("/health").status_code == 503  # open, and says the engine is not ready
    page = client.get("/dashboard")  # a page without data: it asks for the key itself
    assert page.status_code == 200 and "kv/blocks" in page.text


def test_cors_preflight(guarded):
    pre = httpx.options(guarded.url + "/v1/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == "http://example.com"


LIMITED = [
    # (path, body, param, the limit named in the message)
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3}, "n", "at most 2"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 1, "best_of": 4}, "best_of", "at most 3"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c", "d"]}, "prompt", "At most 3 prompts"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "at most 2"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9}, "max_tokens", "at most 8"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 4}, "logprobs", "at most 3"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 9},
     "max_completion_tokens", "at most 8"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 4}, "top_logprobs", "between 0 and 3"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, "n",
     "at most 2"),
]


@pytest.mark.parametrize("path,body,param,limit", LIMITED, ids=[f"{p[4:]}-{par}" for p, _, par, _ in LIMITED])
def test_limit_flags_answer_400(guarded, path, body, param, limit):
    err = assert_error(post(guarded, path, body, headers=AUTH), 400, param)
    assert limit in err["message"], err


def test_body_size_limit(guarded):
    err = assert_error(post(guarded, "/v1/completions", {"model": MODEL, "prompt": "x" * 2000}, headers=AUTH), 413)
    assert "--max-request-body-bytes" in err["message"] and err["code"] == "request_too_large"


def test_requests_at_the_limits_are_served(guarded):
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "best_of": 3, "stop": ["x", "y"], "max_tokens": 2,
            "logprobs": 3, "ignore_eos": True}
    resp = post(guarded, "/v1/completions", body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert [c["index"] for c in resp.json()["choices"]] == list(range(6))


def test_max_tokens_limit_bounds_the_default(guarded):
    """Without max_tokens, completions (default 16) and chat (default: the rest of the context)
    generate at most --max-tokens-limit tokens."""
    comp = post(guarded, "/v1/completions", {"model": MODEL, "prompt": "Once", "ignore_eos": True}, headers=AUTH).json()
    assert comp["usage"]["completion_tokens"] == 8 and comp["choices"][0]["finish_reason"] == "length"
    chat = post(guarded, "/v1/chat/completions", {"model": MODEL, "ignore_eos": True,
                                                   "messages": [{"role": "user", "content": "Tell me a story"}]},
                headers=AUTH).json()
    assert chat["usage"]["completion_tokens"] == 8


def test_queue_bound_429_with_retry_after(guarded):
    async def flood():
        async with httpx.AsyncClient(base_url=guarded.url, timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*[
                client.post("/v1/completions",
                            json={"model": MODEL, "prompt": [f"{SLOW} a", f"{SLOW} b"], "max_tokens": 3})
                for _ in range(6)])

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses, statuses
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert assert_error(rejected, 429)["code"] == "queue_full"
    assert httpx.get(guarded.url + "/health").status_code == 200


# ------------------------------------------------------------------------------ graceful drain
def test_sigterm_drains_then_exits_0():
    """In flight at SIGTERM: a short request (finishes within the drain), a long stream and a
    long non-streaming request (they cannot: at --shutdown-timeout the stream ends with a final
    SSE error event, the other gets a 503 error body)."""
    server = start_server("--engine-factory", FAULTY, *SMALL, "--shutdown-timeout", "8")

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def long_stream() -> tuple[int, str]:
                body = {"model": MODEL, "prompt": f"{SLOW} Once upon a time", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    return resp.status_code, "".join([part async for part in resp.aiter_text()])

            stream = asyncio.ensure_future(long_stream())
            long_full = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"{SLOW} A long list:", "max_tokens": 400, "ignore_eos": True}))
            await asyncio.sleep(1.0)
            short = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            late = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            health = await client.get("/health")
            return await short, late, health, await stream, await long_full

    try:
        short, late, health, (stream_status, stream_text), long_full = asyncio.run(run())
    finally:
        code = server.stop(timeout=60)
    assert short.status_code == 200, short.text
    assert short.json()["choices"][0]["finish_reason"] == "length"
    assert assert_error(late, 503)["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert stream_status == 200
    events = sse_events(stream_text)
    assert any(e.get("choices") for e in events[:-2]), "the stream produced no tokens before the drain"
    assert events[-2]["error"]["code"] == "server_shutting_down"
    assert assert_error(long_full, 503)["code"] == "server_shutting_down"
    assert code == 0, server.log()[-3000:]


# ------------------------------------------------------------------------------- engine death
def test_engine_death_turns_health_503():
    server = start_server("--engine-factory", FAULTY, *SMALL)
    try:
        resp = post(server, "/v1/completions", {"model": MODEL, "prompt": f"{KILL} now", "max_tokens": 3})
        assert resp.status_code in (500, 503)
        assert_error(resp, resp.status_code)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        # NOTE: the reason names no internals; the log has them
        assert health["status"] == "dead" and "loop died" in health["reason"] and "injected" not in health["reason"]
        assert "injected engine death" in server.log()
        assert assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
                            503)["code"] == "engine_dead"
        assert_error(post(server, "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}), 503)
        assert "The engine loop died" in server.log()
        server.proc.send_signal(signal.SIGINT)  # SIGINT drains like SIGTERM: nothing in flight, exit 0
        assert server.proc.wait(30) == 0, server.log()[-3000:]
    finally:
        server.stop()


def test_load_failure_exits_nonzero():
    server = start_server("--engine-factory", "tests.server.faulty_engine:build_failing", wait_healthy=False)
    assert server.proc.wait(60) == 1
    assert "injected load failure" in server.log()
