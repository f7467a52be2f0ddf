"""A request can only hurt itself: hostile requests against one server while a canary stream runs.

For each case one hostile request is sent while a canary (streaming completions, back to back)
keeps reading tokens and /health is polled. Asserted: the hostile request gets a 2xx or a 4xx
with an OpenAI error body (Anthropic's on /v1/messages; never a 5xx, never a hang); the canary
is never silent for more than about a second beyond its normal inter-token gap; /health answers
200 throughout, promptly; no finish_reason (stop_reason) is outside OpenAI's (Anthropic's); the
pool is free afterwards. The classes: KV pressure (samples
that outgrow the pool, widths past max_num_seqs), numeric extremes in every field of the
endpoints, sizes (lists, strings, nesting, bodies), a reader that stops reading, and HTTP
semantics. A representative subset runs in CI; `-m slow` runs every case.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from benchmarks.abuse import FLAGS, MODEL, Canary, echo_logprobs_body, health_poller, send, unread_stream
from tests.server.conftest import start_server
from tests.server.support import wait_pool_free
OPENAI_FINISH = {"stop", "length", "tool_calls", None}
ANTHROPIC_STOP = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
SLACK_S = 1.0  # silence allowed beyond the canary's normal inter-token gap


@pytest.fixture(scope="module")
def abuse():
    server = start_server(*FLAGS, "--log-level", "warning", "--disable-uvicorn-access-log")
    canary = Canary(server.url)
    thread = canary.start()
    canary.wait_started()
    yield server, canary
    canary.stop.set()
    thread.join(30)
    code = server.stop()
    assert code == 0, server.log()[-3000:]


def check(abuse, hostile, expect: tuple[int, ...] = (200, 400)) -> httpx.Response | None:
    """Run `hostile()` (returns the response, or None when it has none to give) under the canary
    and the health poller; assert what the module docstring says. Returns the response."""
    server, canary = abuse
    normal = canary.normal_gap()
    stop, health = threading.Event(), []
    poller = threading.Thread(target=health_poller, args=(server.url, stop, health), daemon=True)
    start = time.monotonic()
    poller.start()
    try:
        resp = hostile()
    finally:
        end = time.monotonic()
        time.sleep(min(1.0, max(0.2, 3 * normal)))  # the canary's next chunk after the hostile request
        stop.set()
        poller.join(15)
    gap = canary.longest_gap(start, end)
    assert gap <= normal + SLACK_S, f"the canary was silent for {gap:.2f} s (normal gap {normal:.3f} s)"
    assert health and all(status == 200 and t < 1.0 for status, t in health), health
    assert not canary.errors, canary.errors
    if resp is not None:
        assert resp.status_code in expect, (resp.status_code, resp.text[:500])
        assert resp.status_code < 500
        anthropic = resp.request.url.path.startswith("/v1/messages")
        if resp.status_code >= 400:
            body = resp.json()
            error = body["error"]
            keys = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
            assert set(error) == keys and error["message"], error
            assert body.get("type") == "error" or not anthropic, body
        elif resp.headers.get("content-type", "").startswith("application/json"):
            for choice in resp.json().get("choices", []):
                assert choice.get("finish_reason") in OPENAI_FINISH, choice
            if anthropic and "stop_reason" in resp.json():
                assert resp.json()["stop_reason"] in ANTHROPIC_STOP, resp.json()
    return resp


# ------------------------------------------------------------------------------ KV pressure
def test_samples_that_outgrow_the_pool_finish_and_hurt_no_one(abuse):
    """The issue's reproducer, scaled to this pool: 16 samples that together need ~60 blocks of
    a 34-block pool (the canary holds some too). It used to swap out for good and wedge the server."""
    server, _ = abuse
    body = {"model": MODEL, "prompt": "Hello", "n": 16, "max_tokens": 60, "ignore_eos": True}
    resp = check(abuse, lambda: send(server.url, "/v1/completions", body))
    choices = resp.json()["choices"]
    assert len(choices) == 16 and all(c["finish_reason"] == "length" for c in choices)
    assert resp.json()["usage"]["completion_tokens"] == 16 * 60
    short = send(server.url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert short.status_code == 200  # the next request is served at once
    wait_pool_free_but_canary(server.url)


@pytest.mark.parametrize("body, param", [
    ({"n": 33}, "n"),  # past --max-num-seqs 32 (under --max-n 64)
    ({"n": 2, "best_of": 40}, "best_of"),
    ({"n": 2, "best_of": 16, "use_beam_search": True, "temperature": 0, "max_tokens": 400}, "best_of"),  # beams > pool
])
def test_widths_that_can_never_run_are_400s_naming_the_numbers(abuse, body, param):
    server, _ = abuse
    resp = check(abuse, lambda: send(server.url, "/v1/completions", {"model": MODEL, "prompt": "Hi", **body}),
                 expect=(400,))
    error = resp.json()["error"]
    assert error["param"] == param and any(ch.isdigit() for ch in error["message"]), error


def test_beam_search_that_fits_runs_beside_the_canary(abuse):
    server, _ = abuse
    body = {"model": MODEL, "prompt": "The capital of France is", "n": 2, "best_of": 4, "use_beam_search": True,
            "temperature": 0, "max_tokens": 24, "length_penalty": 1e308}
    resp = check(abuse, lambda: send(server.url, "/v1/completions", body))
    assert len(resp.json()["choices"]) == 2


def test_echo_logprobs_on_a_prompt_near_the_context_limit_is_chunked_beside_the_canary(abuse):
    """echo + 20 logprobs on a 500-token prompt (context 512, budget 128 tokens a step): its
    prompt is scored chunk by chunk, so the canary keeps its pace, and the answer has an entry
    for every prompt token (the first null)."""
    server, _ = abuse
    body = echo_logprobs_body()
    resp = check(abuse, lambda: send(server.url, "/v1/completions", body), expect=(200,))
    logprobs = resp.json()["choices"][0]["logprobs"]
    n = len(body["prompt"])
    assert len(logprobs["token_logprobs"]) == n + 1 and logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert all(len(top) >= 15 for top in logprobs["top_logprobs"][1:n])  # (texts as keys: a few may coincide)
    wait_pool_free_but_canary(server.url)


def wait_pool_free_but_canary(url: str, timeout: float = 30.0) -> None:
    """No request but the canary holds blocks: at most the canary's (it runs on)."""
    deadline = time.monotonic() + timeout
    while True:
        m = httpx.get(url + "/kv/blocks", timeout=30).json()
        if m["num_running"] <= 1 and m["num_waiting"] == 0 and m["num_swapped"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


# ------------------------------------------------------------------------- numeric extremes
FLOAT_EXTREMES = [0.0, 5e-324, 1e-300, 1e308, -1e308, -0.0, 2.5e-8]
INT_EXTREMES = [0, -1, 2**63 - 1, -(2**63), 2**64, 10**30, 10**300]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]
INT_FIELDS = ["n", "best_of", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"]
CHAT_INT_FIELDS = ["n", "max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed", "top_logprobs"]
ANTHROPIC_FLOAT_FIELDS = ["temperature", "top_p"]
ANTHROPIC_INT_FIELDS = ["max_tokens", "top_k"]
RESPONSES_FLOAT_FIELDS = ["temperature", "top_p"]
RESPONSES_INT_FIELDS = ["max_output_tokens", "max_tool_calls", "top_logprobs"]


def numeric_cases() -> list[tuple]:
    """(endpoint, field, value) for every numeric field of both endpoints and every extreme."""
    cases = []
    for endpoint, ints in (("/v1/completions", INT_FIELDS), ("/v1/chat/completions", CHAT_INT_FIELDS)):
        cases += [(endpoint, f, v) for f in FLOAT_FIELDS for v in FLOAT_EXTREMES]
        cases += [(endpoint, f, v) for f in ints for v in INT_EXTREMES]
        cases += [(endpoint, "logit_bias", (("42", v),)) for v in FLOAT_EXTREMES]
        cases += [(endpoint, "stop_token_ids", (v,)) for v in INT_EXTREMES]
    cases += [("/v1/messages", f, v) for f in ANTHROPIC_FLOAT_FIELDS for v in FLOAT_EXTREMES]
    cases += [("/v1/messages", f, v) for f in ANTHROPIC_INT_FIELDS for v in INT_EXTREMES]
    cases += [("/v1/responses", f, v) for f in RESPONSES_FLOAT_FIELDS for v in FLOAT_EXTREMES]
    cases += [("/v1/responses", f, v) for f in RESPONSES_INT_FIELDS for v in INT_EXTREMES]
    return cases


# NOTE: CI runs these; -m slow runs every combination.
CI_NUMERIC = {("/v1/completions", "top_p", 1e-300), ("/v1/completions", "temperature", 1e308),
              ("/v1/completions", "repetition_penalty", 5e-324), ("/v1/completions", "repetition_penalty", 1e308),
              ("/v1/completions", "min_p", 1e-300), ("/v1/completions", "seed", -(2**63)),
              ("/v1/completions", "max_tokens", 10**300), ("/v1/completions", "top_k", 2**64),
              ("/v1/chat/completions", "top_p", 5e-324), ("/v1/chat/completions", "temperature", 1e-300),
              ("/v1/chat/completions", "presence_penalty", -1e308), ("/v1/chat/completions", "seed", 2**64),
              ("/v1/chat/completions", "max_completion_tokens", 10**30), ("/v1/completions", "length_penalty", 1e308),
              ("/v1/completions", "logit_bias", (("42", 1e308),)), ("/v1/chat/completions", "stop_token_ids", (2**64,)),
              ("/v1/messages", "top_p", 5e-324), ("/v1/messages", "max_tokens", 10**300),
              ("/v1/messages", "top_k", 2**63 - 1),
              ("/v1/responses", "temperature", 1e308), ("/v1/responses", "top_p", 5e-324),
              ("/v1/responses", "max_output_tokens", 10**300), ("/v1/responses", "max_output_tokens", -1)}


def numeric_body(endpoint: str, name: str, value) -> dict:
    if endpoint == "/v1/responses":
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3}
        body[name] = value
        return body
    body = {"model": MODEL, "max_tokens": 3}
    if endpoint == "/v1/completions":
        body["prompt"] = "Hi"
    elif endpoint == "/v1/messages":
        body["messages"] = [{"role": "user", "content": "Hi"}]
        body[name] = value
        return body
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    if name in ("max_tokens", "max_completion_tokens"):
        body.pop("max_tokens")
    if name == "length_penalty":
        body.update(use_beam_search=True, n=2, temperature=0)
    if name in ("logprobs", "prompt_logprobs") and endpoint == "/v1/completions":
        body.update(echo=True, logprobs=1)
    if name == "top_logprobs":
        body["logprobs"] = True
    body[name] = dict(value) if name == "logit_bias" else (list(value) if isinstance(value, tuple) else value)
    return body


def _case_id(case: tuple) -> str:
    endpoint, name, value = case
    text = repr(value)
    where = ("chat" if "chat" in endpoint else "messages" if "messages" in endpoint
             else "responses" if "responses" in endpoint else "completions")
    return f"{where}-{name}-{text if len(text) <= 24 else text[:12] + '...'}"


@pytest.mark.parametrize("endpoint, name, value", [
    pytest.param(*c, marks=() if c in CI_NUMERIC else pytest.mark.slow, id=_case_id(c)) for c in numeric_cases()])
def test_numeric_extremes_are_2xx_or_4xx(abuse, endpoint, name, value):
    server, _ = abuse
    check(abuse, lambda: send(server.url, endpoint, numeric_body(endpoint, name, value), timeout=120))


# ------------------------------------------------------------------------------------ sizes
def big_bodies() -> dict:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    comp = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    nested_input: dict = {}
    for _ in range(55):  # under --max-json-depth with the body's own levels
        nested_input = {"a": nested_input}
    resp = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"x": 1}'}
    nested = b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return {
        "40k_tools": ("/v1/chat/completions", {**chat, "tools": [
            {**tool, "function": {**tool["function"], "name": f"tool_{i}"}} for i in range(40_000)]}),
        "100k_stop_token_ids": ("/v1/completions", {**comp, "stop_token_ids": list(range(100_000))}),
        "50k_logit_bias": ("/v1/completions", {**comp, "logit_bias": {str(i): 1.0 for i in range(50_000)}}),
        "long_stop_string": ("/v1/completions", {**comp, "stop": ["x" * 100_000]}),
        "many_stop_strings": ("/v1/completions", {**comp, "stop": [f"s{i}" for i in range(10_000)]}),
        "16_stop_strings_at_the_limit": ("/v1/completions", {**comp, "max_tokens": 40, "stop": [
            "ab" * 128] * 15 + ["."]}),
        "5k_messages": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}] * 5000}),
        "3MB_prompt": ("/v1/completions", {**comp, "prompt": "hello world " * 250_000}),
        "3MB_tokenize": ("/tokenize", {"model": MODEL, "prompt": "hello world " * 250_000}),
        "64_prompts": ("/v1/completions", {**comp, "prompt": [[i % 1000 + 10] * 60 for i in range(64)]}),
        "deep_nesting": ("/v1/completions", nested),
        "5000_digit_int": ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "seed": '
                           + b"9" * 5000 + b"}"),
        "slow_regex": ("/v1/completions", {**comp, "guided_regex": "(a{1000}){1000}"}),
        "huge_choice": ("/v1/completions", {**comp, "guided_choice": [f"c{i}" for i in range(100_000)]}),
        "500k_detokenize": ("/detokenize", {"model": MODEL, "tokens": [42] * 500_000}),
        "5MB_body": ("/v1/completions", {**comp, "prompt": "x" * (5 * 1024 * 1024)}),
        "missing_model": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        # Anthropic's /v1/messages: the same limits under its own field names
        "messages_40k_tools": ("/v1/messages", {**msgs, "tools": [
            {"name": f"tool_{i}", "input_schema": {"type": "object"}} for i in range(40_000)]}),
        "messages_many_stop_sequences": ("/v1/messages", {**msgs, "stop_sequences": [f"s{i}" for i in range(10_000)]}),
        "messages_long_stop_sequence": ("/v1/messages", {**msgs, "stop_sequences": ["x" * 100_000]}),
        "messages_5k_messages": ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": "hi"}] * 5000}),
        "messages_10k_blocks": ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}] * 10_000}]}),
        "messages_3MB_tool_result": ("/v1/messages", {**msgs, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "hello world " * 250_000}]}]}),
        "messages_deep_tool_input": ("/v1/messages", {**msgs, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": nested_input}]},
            {"role": "user", "content": "Hi"}]}),
        "messages_3MB_count_tokens": ("/v1/messages/count_tokens", {"model": MODEL, "messages": [
            {"role": "user", "content": "hello world " * 250_000}]}),
        "messages_missing_max_tokens": ("/v1/messages", {"model": MODEL, "messages": msgs["messages"]}),
        "messages_5MB_body": ("/v1/messages", {**msgs, "system": "x" * (5 * 1024 * 1024)}),
        "5k_input_items": ("/v1/responses", {**resp, "input": [{"role": "user", "content": "hi"}] * 5000}),
        "2k_function_calls": ("/v1/responses", {**resp, "input": [{"role": "user", "content": "hi"}] + [
            {**call, "call_id": f"c{i}"} for i in range(2000)]}),
        "3MB_instructions": ("/v1/responses", {**resp, "instructions": "hello world " * 250_000}),
        "40k_response_tools": ("/v1/responses", {**resp, "tools": [
            {"type": "function", "name": f"tool_{i}"} for i in range(40_000)]}),
        "3MB_previous_response_id": ("/v1/responses", {**resp, "previous_response_id": "r" * 3_000_000}),
        "1k_metadata": ("/v1/responses", {**resp, "metadata": {f"k{i}": "v" * 512 for i in range(1000)}}),
    }


CI_SIZES = {"40k_tools", "100k_stop_token_ids", "long_stop_string", "5k_messages", "3MB_prompt", "deep_nesting",
            "slow_regex", "5MB_body", "missing_model", "16_stop_strings_at_the_limit", "messages_40k_tools",
            "messages_long_stop_sequence", "messages_3MB_tool_result", "messages_missing_max_tokens",
            "messages_5MB_body", "5k_input_items",
            "2k_function_calls", "3MB_previous_response_id"}
EXPECT = {"5MB_body": (413,), "missing_model": (400,), "16_stop_strings_at_the_limit": (200,), "3MB_tokenize": (200,),
          "64_prompts": (200,), "500k_detokenize": (200, 400), "messages_3MB_count_tokens": (200,),
          "messages_deep_tool_input": (200, 400), "messages_5MB_body": (413,),
          "3MB_previous_response_id": (404,)}


@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in CI_SIZES else pytest.mark.slow)
                                  for name in big_bodies()])
def test_oversized_inputs_are_refused_or_served_without_stalling_anyone(abuse, case):
    server, _ = abuse
    path, body = big_bodies()[case]
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()  # built before the clock starts
    check(abuse, lambda: send(server.url, path, payload, timeout=300), expect=EXPECT.get(case, (400,)))


# ------------------------------------------------------------------------ a reader that stops
def test_a_stalled_streaming_reader_costs_the_others_nothing(abuse):
    """A client that asks for 16 streamed samples and never reads: the server coalesces what it
    cannot send (bounded memory), the canary keeps its pace, and closing frees everything."""
    server, _ = abuse
    check(abuse, lambda: unread_stream(server.url))
    wait_pool_free_but_canary(server.url)


@pytest.mark.slow
def test_the_issues_reproducer_on_its_own_server():
    """Exactly the issue's first reproducer: --max-model-len 1024 --kv-cache-memory 64MiB
    --swap-space 0.0625 and one n=16, max_tokens=1000 request; then a 3-token request."""
    server = start_server("--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--swap-space", "0.0625",
                          "--log-level", "warning", "--disable-uvicorn-access-log")
    try:
        big = {"model": MODEL, "prompt": "Hello", "n": 16, "max_tokens": 1000, "ignore_eos": True}
        answers: list[httpx.Response] = []
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            pending = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=big)))
            pending.start()
            time.sleep(20)  # the pool is full by now
            t0 = time.monotonic()
            small = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
            assert small.status_code == 200 and time.monotonic() - t0 < 10
            assert httpx.get(server.url + "/health").status_code == 200
            pending.join(3600)
        assert answers[0].status_code == 200 and len(answers[0].json()["choices"]) == 16
        wait_pool_free(server.url)
    finally:
        server.stop()
