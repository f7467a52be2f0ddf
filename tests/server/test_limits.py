"""Request limits and hostile bodies: a request can only hurt itself. Whatever one request
carries, it gets its answer or a clear 4xx in OpenAI's error shape (never a 500, a hang or a
crash), and the server stays healthy.

- the pieces on their own: the limit flags, the JSON value check, plan_tools' limits (and that
  it is linear in the number of tools), stop_token_ids deduplicated, internal error text kept
  out of answers, API-key auth (an app that never starts its engine);
- a server started with small limits: one hostile request per limit, a 400 naming the field;
  413 for a body over --max-request-body-bytes, by Content-Length or chunked;
- the shared real server (default limits): the tool limits, a missing model, JSON bodies that
  Python's parser mishandles, and extreme numbers in every numeric field.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.loop.async_engine import EngineDeadError, RequestFailedError
from server.app import create_app
from server.cli import parse_args
from server.errors import OpenAIError, from_engine_error
from server.middleware import json_body_error
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonTooDeep,
    JsonValueError,
    check_json_value,
)
from server.sampling import completion_params
from server.settings import ServerSettings
from server.streaming import sse_error
from server.tools import plan_tools
from tests.server.conftest import REAL_FLAGS, start_server
from tests.server.support import assert_error, post

ASK = [{"role": "user", "content": "hi"}]


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


def nested(depth: int) -> str:
    """A JSON object nested `depth` levels deep."""
    return '{"a":' * depth + "1" + "}" * depth


# ------------------------------------------------------------------------------ unit tests
def test_limit_flags_reach_the_settings(monkeypatch):
    monkeypatch.delenv("PAGED_SERVE_API_KEY", raising=False)
    flags = {"--max-prompt-tokens-per-request": ("max_prompt_tokens_per_request", "100", 100),
             "--max-stop-str-len": ("max_stop_str_len", "7", 7),
             "--max-stop-token-ids": ("max_stop_token_ids", "3", 3),
             "--max-logit-bias": ("max_logit_bias", "5", 5),
             "--max-messages": ("max_messages", "6", 6),
             "--max-messages-chars": ("max_messages_chars", "99", 99),
             "--max-tools": ("max_tools", "2", 2),
             "--max-tool-schema-bytes": ("max_tool_schema_bytes", "2KiB", 2048),
             "--max-total-tool-schema-bytes": ("max_total_tool_schema_bytes", "3000", 3000),
             "--max-guided-choices": ("max_guided_choices", "9", 9),
             "--max-structured-output-bytes": ("max_structured_output_bytes", "1KiB", 1024),
             "--max-json-depth": ("max_json_depth", "12", 12),
             "--engine-stall-timeout": ("engine_stall_timeout", "7.5", 7.5)}
    settings = parse_args([arg for flag, (_, value, _) in flags.items() for arg in (flag, value)]).settings
    for name, _, expected in flags.values():
        assert getattr(settings, name) == expected, name
    defaults = parse_args([]).settings
    assert defaults == ServerSettings(), "a flag's default differs from the ServerSettings default"
    assert (defaults.max_tools, defaults.max_tool_schema_bytes, defaults.max_total_tool_schema_bytes) == (
        128, 64 * 1024, 1024 * 1024)
    assert defaults.engine_stall_timeout == 120.0 and defaults.max_prompt_tokens_per_request == 262144


@pytest.mark.parametrize("flag", ["--max-json-depth", "--max-tools", "--max-stop-token-ids"])
def test_limit_flags_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        parse_args([flag, "0"])
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value,depth,problem", [
    (1, 0, None), ([], 0, JsonTooDeep), ([], 1, None), ([[]], 1, JsonTooDeep), ({"a": {"b": [1]}}, 3, None),
    ({"a": {"b": [1]}}, 2, JsonTooDeep), ([1, True, None, 2.5, "x", "😀"], 1, None),
    ([1.0, float("inf")], 2, JsonValueError), ({"x": [float("nan")]}, 3, JsonValueError),
    (["ok", "\ud800"], 2, JsonValueError), ({"\udc00": 1}, 2, JsonValueError),
])
def test_check_json_value(value, depth, problem):
    if problem is None:
        check_json_value(value, depth)
    else:
        with pytest.raises(problem):
            check_json_value(value, depth)


def test_check_json_value_is_iterative_and_fast():
    deep = json.loads("[" * 900 + "]" * 900)  # deeper than any recursive walk could go safely
    with pytest.raises(JsonTooDeep):
        check_json_value(deep, 64)
    check_json_value(deep, 1000)
    wide = [{}] * 1_000_000
    start = time.monotonic()
    check_json_value(wide, 3)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("body,param", [
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"prompt": "x", "n": ' + b"1" * 5000 + b"}", None),
    (b'{"temperature": NaN}', None), (b'{"top_p": -Infinity}', None),
    (b'{"prompt": "\xff\xfe"}', None),
    (b'{"temperature": 1e400}', "temperature"),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (('{"tools": ' + nested(70) + "}").encode(), "tools"),
])
def test_json_body_error(body, param):
    error = json_body_error(body, 64)
    assert error is not None and error.status == 400 and error.param == param, error and error.message


def test_json_syntax_errors_are_left_to_fastapi():
    assert json_body_error(b"{bad", 64) is None
    assert json_body_error(b'\xef\xbb\xbf{"prompt": "x"}', 64) is None  # a UTF-8 BOM, as FastAPI takes it


def _plan(settings: ServerSettings, **body):
    return plan_tools(ChatCompletionRequest(model="m", messages=ASK, **body), settings)


@pytest.mark.parametrize("settings,tools,param", [
    (ServerSettings(max_tools=2), [tool("a"), tool("b"), tool("c")], "tools"),
    (ServerSettings(max_tool_schema_bytes=200), [tool("a"), tool("b", {"type": "object", "description": "x" * 200})],
     "tools.1.function"),
    (ServerSettings(max_total_tool_schema_bytes=100), [tool(f"tool_number_{i}") for i in range(5)], "tools"),
    (ServerSettings(max_json_depth=8), [tool("a", json.loads('{"type": "object", "properties": ' + nested(8) + "}"))],
     "tools.0.function.parameters"),
    (ServerSettings(), [tool("a"), tool("a")], "tools.1.function.name"),
], ids=["count", "one-size", "total-size", "depth", "duplicate"])
def test_plan_tools_limits(settings, tools, param):
    with pytest.raises(OpenAIError) as info:
        _plan(settings, tools=tools)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_plan_tools_at_the_limits_is_fine():
    settings = ServerSettings(max_tools=3, max_json_depth=8)
    plan = _plan(settings, tools=[tool("a"), tool("b"), tool("c", {"type": "object", "properties": {"x": {}}})],
                 tool_choice="required")
    assert plan.mode == "required" and plan.names == {"a", "b", "c"}


def test_plan_tools_is_linear_in_the_number_of_tools():
    """The name check was a scan of the names so far per tool: quadratic, tens of seconds for
    40,000 tools on the event loop."""
    settings = ServerSettings(max_tools=50_000, max_total_tool_schema_bytes=10**8)
    req = ChatCompletionRequest(model="m", messages=ASK, tools=[tool(f"f{i}") for i in range(40_000)])
    start = time.monotonic()
    assert len(plan_tools(req, settings).functions) == 40_000
    assert time.monotonic() - start < 5.0


def test_stop_token_ids_are_deduplicated():
    req = CompletionRequest(model="m", prompt="hi", stop_token_ids=[5, 2, 5, 5, 2, 9])
    assert completion_params(req, ServerSettings(), 100).stop_token_ids == [5, 2, 9]


def test_internal_error_text_stays_in_the_log(caplog):
    secret = "RuntimeError: secret detail at /home/x/engine.py:12"
    failed = from_engine_error(RequestFailedError(f"Internal error while generating: {secret}"), in_flight=True)
    dead_in_flight = from_engine_error(EngineDeadError(f"The engine loop died: {secret}"), in_flight=True)
    dead = from_engine_error(EngineDeadError(f"The engine failed to load: {secret}"))
    bug = from_engine_error(KeyError("secret"))
    assert [e.status for e in (failed, dead_in_flight, dead, bug)] == [500, 500, 503, 500]
    for error in (failed, dead_in_flight, dead, bug):
        assert "secret" not in error.message and "Error" not in error.message, error.message
        assert "secret" not in sse_error(error)
    assert "secret" in caplog.text


# --------------------------------------------------------------- auth (no engine started)
@pytest.fixture(scope="module")
def guarded_app():
    def never_built():
        raise AssertionError("the engine must not be started by this test")

    # NOTE: not as a context manager: the lifespan (engine start) never runs.
    return TestClient(create_app(parse_args(["--api-key", "sekret"]).settings, never_built))


@pytest.mark.parametrize("header", ["Bearer sekret", "bearer sekret", "BEARER sekret", "bEaReR  sekret"])
def test_bearer_scheme_is_case_insensitive(guarded_app, header):
    assert guarded_app.get("/version", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("header", ["Bearer nope", "Basic sekret", "sekret", "Bearer", "Bearer sekret2"])
def test_wrong_credentials_are_401(guarded_app, header):
    assert_error(guarded_app.get("/version", headers={"Authorization": header}), 401)


def test_authorization_given_twice_is_refused(guarded_app):
    for second in ("Bearer sekret", "Bearer nope"):
        resp = guarded_app.get("/version", headers=[("Authorization", "Bearer sekret"), ("Authorization", second)])
        assert "once" in assert_error(resp, 401)["message"]


# ------------------------------------------------------- a server with small limits
LIMIT_FLAGS = ["--max-stop-str-len", "8", "--max-stop-token-ids", "4", "--max-logit-bias", "4",
               "--max-messages", "4", "--max-messages-chars", "100", "--max-guided-choices", "3",
               "--max-structured-output-bytes", "512", "--max-json-depth", "8", "--max-request-body-bytes", "64KiB"]


@pytest.fixture(scope="module")
def limited():
    server = start_server(*REAL_FLAGS, *LIMIT_FLAGS)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _completion(model: str, **fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, **fields}


def _chat(model: str, **fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 1, **fields}


LIMITED = {  # name: (request, param)
    "stop-str-len": (lambda m: _completion(m, stop=["ok", "x" * 9]), "stop"),
    "stop-token-ids": (lambda m: _completion(m, stop_token_ids=[1, 2, 3, 4, 5]), "stop_token_ids"),
    "logit-bias": (lambda m: _completion(m, logit_bias={str(i): 1 for i in range(5)}), "logit_bias"),
    "messages": (lambda m: _chat(m, messages=ASK * 5), "messages"),
    "messages-chars": (lambda m: _chat(m, messages=[{"role": "user", "content": "x" * 101}]), "messages"),
    "messages-chars-parts": (lambda m: _chat(m, messages=[{"role": "user", "content": [
        {"type": "text", "text": "x" * 60}, {"type": "text", "text": "y" * 60}]}]), "messages"),
    "guided-choices": (lambda m: _completion(m, guided_choice=["a", "b", "c", "d"]), "guided_choice"),
    "structured-bytes": (lambda m: _chat(m, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 600}}}), "response_format"),
    "regex-bytes": (lambda m: _completion(m, guided_regex="a" * 513), "guided_regex"),
    "json-depth": (lambda m: _chat(m, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads(nested(8))}}), "response_format"),
    "json-string-depth": (lambda m: _completion(m, guided_json=nested(9)), "guided_json"),
}


@pytest.mark.parametrize("name", list(LIMITED))
def test_each_limit_is_a_400_naming_the_field(limited, model, name):
    make, param = LIMITED[name]
    path, body = make(model)
    assert_error(post(limited, path, body), 400, param)


def test_requests_at_the_limits_are_served(limited, model):
    for path, body in (
        _completion(model, stop=["x" * 8], stop_token_ids=[1, 2, 3, 3], logit_bias={str(i): 1 for i in range(4)}),
        _completion(model, guided_choice=["a", "b", "c"]),
        _chat(model, messages=[{"role": "user", "content": "x" * 25}] * 4),
    ):
        resp = post(limited, path, body)
        assert resp.status_code == 200, resp.text


def test_body_over_the_limit_is_413(limited, model):
    path, body = _completion(model, prompt="x" * 70_000)
    error = assert_error(post(limited, path, body), 413)
    assert error["code"] == "request_too_large" and "--max-request-body-bytes" in error["message"]


def test_chunked_body_over_the_limit_is_413(limited, model):
    path, body = _completion(model, prompt="x" * 70_000)
    raw = json.dumps(body).encode()

    def chunks():  # no Content-Length: sent with Transfer-Encoding: chunked
        for start in range(0, len(raw), 8192):
            yield raw[start:start + 8192]

    resp = httpx.post(limited.url + path, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    assert assert_error(resp, 413)["code"] == "request_too_large"
    assert httpx.get(limited.url + "/health").status_code == 200


# --------------------------------------------------- the shared real server (default limits)
def test_tool_limits_with_the_defaults(real_server, model):
    big = {"type": "object", "description": "x" * (64 * 1024)}
    large = {"type": "object", "description": "x" * (63 * 1024)}
    for tools, param in (([tool(f"f{i}") for i in range(129)], "tools"),
                         ([tool("a"), tool("b", big)], "tools.1.function"),
                         ([tool(f"f{i}", large) for i in range(17)], "tools")):
        path, body = _chat(model, tools=tools, tool_choice="required")
        assert_error(post(real_server, path, body), 400, param)


def test_model_is_required_on_the_generating_routes(real_server, model):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1})):
        error = assert_error(post(real_server, path, body), 400, "model")
        assert error["message"] == "Missing required parameter: 'model'."
    assert post(real_server, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert post(real_server, "/detokenize", {"tokens": [1, 2]}).status_code == 200


def _raw(model: str, path: str, fields: str) -> tuple[str, bytes]:
    start = {"/v1/completions": f'{{"model": "{model}", "prompt": "hi", "max_tokens": 1, ',
             "/v1/chat/completions": f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], '
                                     '"max_tokens": 1, ',
             "/tokenize": "{"}[path]
    return path, (start + fields + "}").encode()


C, H = "/v1/completions", "/v1/chat/completions"
CALL_ARGS = '"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c", ' \
            '"function": {"name": "f", "arguments": %s}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}]'
EDGE_CASES = {  # name: (path, the fields after the usual ones, param or "<any>"); all answered 400
    "deep-arrays": (C, '"x": ' + "[" * 100_000 + "]" * 100_000, "<any>"),
    "deep-objects": (C, '"x": ' + nested(100_000), "<any>"),
    "deep-tool-schema": (H, '"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", '
                            '"parameters": {"type": "object", "properties": ' + nested(900) + "}}}]", "tools"),
    "deep-guided-json": (C, '"guided_json": ' + nested(900), "guided_json"),
    "deep-guided-json-string": (C, '"guided_json": ' + json.dumps(nested(5000)), "guided_json"),
    "deep-call-arguments": (H, CALL_ARGS % json.dumps("[" * 5000 + "]" * 5000),
                            "messages.1.tool_calls.0.function.arguments"),
    "int-5000-digits": (C, '"seed": ' + "7" * 5000, "<any>"),
    "int-5000-digits-unknown-field": (C, '"zz": ' + "7" * 5000, "<any>"),
    "1e400-temperature": (C, '"temperature": 1e400', "temperature"),
    "1e400-schema": (C, '"guided_json": {"type": "object", "maxProperties": 1e400}', "guided_json"),
    "nan": (C, '"temperature": NaN', "<any>"),
    "infinity": (C, '"top_p": Infinity', "<any>"),
    "nan-in-schema": (H, '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": NaN}}}]',
                      "<any>"),
    "lone-surrogate-stop": (C, '"stop": ["\\ud800"]', "stop"),
    "lone-surrogate-prompt": (C, '"prompt": "x\\ud800"', "prompt"),  # the last of two keys counts
    "lone-surrogate-tokenize": ("/tokenize", '"prompt": "\\ud83d"', "prompt"),
    "lone-surrogate-message": (H, '"messages": [{"role": "user", "content": "a\\udc00"}]', "messages"),
    "lone-surrogate-key": (C, '"\\ud83d": 1', None),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_json_edge_cases_are_400(real_server, model, name):
    path, fields, param = EDGE_CASES[name]
    path, body = _raw(model, path, fields)
    assert_error(post(real_server, path, body), 400, param)
    assert httpx.get(real_server.url + "/health").status_code == 200


@pytest.mark.parametrize("body", [b'{"prompt": "\xff"}', b"[1]", b"5", b"null", b'"x"'])
def test_bodies_that_are_not_json_objects_are_400(real_server, body):
    assert_error(post(real_server, "/v1/completions", body), 400)


def test_utf8_bom_and_surrogate_pairs_are_fine(real_server, model):
    path, body = _raw(model, C, '"stop": ["\\ud83d\\ude00"]')
    assert post(real_server, path, b"\xef\xbb\xbf" + body).status_code == 200


BIG = 10**100
INT_FIELDS = {C: ["n", "best_of", "max_tokens", "logprobs", "prompt_logprobs", "min_tokens", "top_k", "seed"],
              H: ["max_tokens", "max_completion_tokens", "top_logprobs"]}
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]
INT_VALUES = [BIG, -BIG, 2**63, 1.5, 1e300]
FLOAT_VALUES = [1e308, -1e308, 5e-324, -5e-324, 1e-300, 0.0]


def _number_cases() -> list:
    cases = [(path, f, v) for path, fields in INT_FIELDS.items() for f in fields for v in INT_VALUES]
    cases += [(C, f, v) for f in FLOAT_FIELDS for v in FLOAT_VALUES]
    cases += [(C, "stop_token_ids", [v]) for v in (BIG, -BIG)] + [(C, "prompt", [v]) for v in (BIG, -BIG)]
    cases += [(C, "logit_bias", {str(BIG): 1}), (C, "logit_bias", {"-1": 1})]
    cases += [(C, "logit_bias", {"5": v}) for v in (1e308, -1e308, 5e-324)]
    return [pytest.param(path, f, v, id=f"{'chat' if path == H else 'completions'}-{f}={str(v)[:16]}")
            for path, f, v in cases]


def _with_needs(field: str, value, body: dict) -> dict:
    """What a field needs next to it to be looked at (not refused for its company)."""
    if field == "prompt_logprobs":
        body.update(echo=True, logprobs=1)
    elif field == "top_logprobs":
        body["logprobs"] = True
    elif field == "length_penalty":
        body.update(use_beam_search=True, n=2, temperature=0)
    return {**body, field: value}


@pytest.mark.parametrize("path,field,value", _number_cases())
def test_extreme_numbers_are_answered_or_refused(real_server, model, path, field, value):
    _, body = (_completion if path == C else _chat)(model)
    resp = post(real_server, path, _with_needs(field, value, body))
    if resp.status_code != 200:
        assert_error(resp, 400)
    assert httpx.get(real_server.url + "/health").status_code == 200
