"""The server over a fake engine (no model): protocol details, error mapping, auth, limits,
fault isolation, engine death, queue bound and graceful drain. Fast: no forward passes."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import FAKE, start_server


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param != "<any>":
        assert error["param"] == param, error
    return error


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


BAD_COMPLETIONS = [
    # (body, param)
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [300]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "x" * 100, "max_tokens": 100}, "prompt"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"prompt": "hi", "max_tokens": 10**12}, "prompt"),
]

BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(b)[:60] for b, _ in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(fake_server, body, param):
    assert_error(post(fake_server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(b)[:60] for b, _ in BAD_CHAT])
def test_bad_chat_requests_are_400(fake_server, body, param):
    assert_error(post(fake_server, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("body", ["{bad json", "[1, 2]", "null", '"text"', "",
                                  '{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "top_p": Infinity}'])
def test_malformed_bodies_are_400(fake_server, body):
    assert_error(post(fake_server, "/v1/completions", body), 400)
    assert_error(post(fake_server, "/v1/chat/completions", body), 400)


def test_context_length_message(fake_server):
    err = assert_error(post(fake_server, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 100}), 400, "prompt")
    assert err["message"].startswith("This model's maximum context length is 128 tokens. However, you requested")
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(fake_server):
    err = assert_error(post(fake_server, "/v1/completions", {"prompt": "hi", "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(post(fake_server, "/v1/chat/completions",
                      {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), 404, "model")
    assert_error(httpx.get(fake_server.url + "/v1/models/gpt-4"), 404)
    assert httpx.get(fake_server.url + "/v1/models/fake-model").json()["id"] == "fake-model"


def test_unknown_route_and_method(fake_server):
    assert_error(httpx.get(fake_server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(fake_server.url + "/v1/completions"), 405)


def test_extra_fields_are_ignored(fake_server):
    resp = post(fake_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert resp.status_code == 200


def test_multi_prompt_indexes_and_usage(fake_server):
    resp = post(fake_server, "/v1/completions", {"prompt": ["ab", "xy"], "max_tokens": 3, "n": 2})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["cde", "def", "zab", "abc"]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}


def test_stop_string_and_finish_reasons(fake_server):
    c = post(fake_server, "/v1/completions", {"prompt": "a", "max_tokens": 10, "stop": ["e"]}).json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("bcd", "stop", "e")
    c = post(fake_server, "/v1/completions", {"prompt": "a", "max_tokens": 10, "stop": "e",
                                              "include_stop_str_in_output": True}).json()["choices"][0]
    assert c["text"] == "bcde"
    c = post(fake_server, "/v1/completions", {"prompt": "a", "max_tokens": 2}).json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == ("bc", "length")


def test_streaming_framing_with_usage_and_n(fake_server):
    body = {"prompt": "a", "max_tokens": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(post(fake_server, "/v1/completions", body).text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    texts: dict[int, str] = {}
    for event in events[:-2]:
        assert event["object"] == "text_completion" and event["usage"] is None
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "bcde", 1: "cdef"}


def test_streaming_without_usage_has_no_usage_key(fake_server):
    events = sse_events(post(fake_server, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}).text)
    assert all("usage" not in e for e in events[:-1])
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_client_roundtrip(fake_server):
    client = openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert len(choice.logprobs.content) == 3
    for entry in choice.logprobs.content:
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_tokenize_detokenize(fake_server):
    tok = post(fake_server, "/tokenize", {"prompt": "hey"}).json()
    assert tok == {"count": 3, "max_model_len": 128, "tokens": [104, 101, 121]}
    assert post(fake_server, "/detokenize", {"tokens": [104, 101, 121]}).json() == {"prompt": "hey"}
    assert_error(post(fake_server, "/detokenize", {"tokens": [999]}), 400, "tokens")
    assert_error(post(fake_server, "/tokenize", {}), 400)


def test_version_and_health(fake_server):
    assert httpx.get(fake_server.url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(fake_server.url + "/version").json()


def test_request_failure_is_isolated(fake_server):
    async def run():
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=30) as client:
            good = [client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 20}) for i in range(4)]
            bad = client.post("/v1/completions", json={"prompt": "FAIL_REQUEST", "max_tokens": 20})
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(run())
    assert_error(bad, 500)
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    assert httpx.get(fake_server.url + "/health").status_code == 200


def test_engine_reported_failure_is_a_500(fake_server):
    err = assert_error(post(fake_server, "/v1/completions", {"prompt": "ERROR_FIELD", "max_tokens": 5}), 500)
    assert "injected sampling failure" in err["message"]
    assert post(fake_server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_request_failure_while_streaming_is_an_error_event(fake_server):
    events = sse_events(post(fake_server, "/v1/completions",
                             {"prompt": "FAIL_REQUEST", "max_tokens": 5, "stream": True}).text)
    assert "error" in events[-2] and events[-2]["error"]["type"] == "server_error"


def test_disconnect_mid_stream_frees_blocks(fake_server):
    with httpx.stream("POST", fake_server.url + "/v1/completions", timeout=30,
                      json={"prompt": "SLOW", "max_tokens": 100, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(fake_server.url + "/kv/blocks").json()["num_free"] < 64
    deadline = time.monotonic() + 5
    while httpx.get(fake_server.url + "/kv/blocks").json()["num_free"] != 64:
        assert time.monotonic() < deadline, "blocks not freed after the client left"
        time.sleep(0.05)
    metrics = httpx.get(fake_server.url + "/metrics").text
    assert "paged_serve:client_disconnects_total" in metrics


def test_disconnect_non_streaming_frees_blocks(fake_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/completions", json={"prompt": "SLOW", "max_tokens": 100}, timeout=0.5)
    deadline = time.monotonic() + 5
    while httpx.get(fake_server.url + "/kv/blocks").json()["num_free"] != 64:
        assert time.monotonic() < deadline, "blocks not freed after the client left"
        time.sleep(0.05)


# --------------------------------------------------------------- servers with their own flags
def test_api_key():
    server = start_server("--engine-factory", FAKE, "--api-key", "sekret", "--log-level", "warning")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert_error(post(server, "/v1/completions", body), 401)
        assert_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
        ok = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert_error(httpx.get(server.url + "/metrics"), 401)
        assert_error(httpx.get(server.url + "/v1/models"), 401)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert openai.OpenAI(base_url=server.url + "/v1", api_key="sekret").models.list().data
    finally:
        server.stop()


def test_api_key_from_env_and_public_metrics():
    server = start_server("--engine-factory", FAKE, "--metrics-public", "--log-level", "warning",
                          env={"PAGED_SERVE_API_KEY": "envkey"})
    try:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/kv/blocks").status_code == 200
        assert_error(httpx.get(server.url + "/v1/models"), 401)
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer envkey"}).status_code == 200
    finally:
        server.stop()


def test_limits_cors_and_queue_bound():
    server = start_server("--engine-factory", FAKE, "--max-request-body-bytes", "1KiB", "--max-queued-requests", "2",
                          "--allowed-origins", "http://example.com", "--max-n", "2", "--log-level", "warning")
    try:
        assert_error(post(server, "/v1/completions", {"prompt": "x" * 2000}), 400)
        assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": 3}), 400, "n")
        pre = httpx.options(server.url + "/v1/completions", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "http://example.com"

        async def flood():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*[
                    client.post("/v1/completions", json={"prompt": ["SLOW a", "SLOW b"], "max_tokens": 3})
                    for _ in range(6)])

        statuses = sorted(r.status_code for r in asyncio.run(flood()))
        assert 200 in statuses and 429 in statuses, statuses
        rejected = next(r for r in asyncio.run(flood()) if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1"
        assert_error(rejected, 429)
    finally:
        server.stop()


def test_graceful_drain_finishes_in_flight_then_exits_0():
    server = start_server("--engine-factory", FAKE, "--shutdown-timeout", "20", "--log-level", "warning")

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            inflight = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "SLOW", "max_tokens": 20}))
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            late = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            health = await client.get("/health")
            return await inflight, late, health

    done, late, health = asyncio.run(run())
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
    assert_error(late, 503)
    assert health.status_code == 503
    assert server.proc.wait(30) == 0


def test_drain_timeout_ends_streams_with_an_error_event():
    server = start_server("--engine-factory", FAKE, "--shutdown-timeout", "0.5", "--log-level", "warning")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "SLOW", "max_tokens": 120, "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        text = "".join(line + "\n\n" for line in [first, *lines] if line)
    events = sse_events(text)
    assert events[-2]["error"]["code"] == "server_shutting_down"
    assert server.proc.wait(30) == 0


def test_engine_death_turns_health_503():
    server = start_server("--engine-factory", FAKE, "--log-level", "warning")
    try:
        resp = post(server, "/v1/completions", {"prompt": "KILL_ENGINE", "max_tokens": 3})
        assert resp.status_code in (500, 503)
        assert_error(resp, resp.status_code)
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert_error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}), 503)
        assert "engine loop died" in server.log()
    finally:
        server.stop()


def test_load_failure_exits_nonzero():
    server = start_server("--engine-factory", "tests.server.fake_engine:build_failing", wait_healthy=False)
    assert server.proc.wait(60) == 1
    assert "injected load failure" in server.log()


def test_health_503_while_loading():
    server = start_server("--engine-factory", "tests.server.fake_engine:build_slow", "--log-level", "warning",
                          wait_healthy=False)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(server.url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        loading = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert_error(loading, 503)
        assert loading.headers["retry-after"] == "1"
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        server.stop()
