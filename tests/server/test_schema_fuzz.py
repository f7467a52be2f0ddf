"""Schema-driven fuzzing with schemathesis: requests generated from the server's own OpenAPI
schema (/openapi.json), both schema-valid ("positive") and schema-violating ("negative"), sent
to the shared real server (default model). Every answer must come back (no hang: a per-request
timeout) and be below 500; every error must be in OpenAI's shape (Anthropic's on /v1/messages);
afterwards the server is healthy and its KV pool all free.

Generations stay tiny: before a request is sent, a positive max_tokens / max_completion_tokens
(or a missing one, whose default may be the rest of the context) becomes at most 2, and n and
best_of at most 2. Negative and zero values are kept: they must answer 400.

Most schema-valid bodies are still refused for reasons the schema does not say (an unknown
model name, out-of-vocabulary token ids, an empty prompt): half of the positive cases are
"repaired" on those points first, so that they reach the engine and generate (and half of the
GET /v1/models/{model} cases ask for the served model).

CI runs a few dozen requests per endpoint; `-m slow` runs 500+ per endpoint that has inputs
(PAGED_SERVE_SCHEMA_FUZZ=N sets the count per generation mode). The GET routes without
parameters (/health, /version, /v1/models, /metrics, /kv/blocks, /livez, /server_info,
/model_info, /get_load) have exactly one possible request each; it is sent too.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server.support import wait_pool_free

TIMEOUT_S = 60  # one request; past it the server counts as hung
GENERATING = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages", "POST /v1/responses"}
WITH_INPUTS = ["POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
               "GET /v1/models/{model}", "GET /kv/requests/{request_id}",
               "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses",
               "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
               "GET /v1/responses/{response_id}/input_items"]
WITHOUT_INPUTS = ["GET /health", "GET /version", "GET /v1/models", "GET /metrics", "GET /kv/blocks",
                  "GET /livez", "GET /server_info", "GET /model_info", "GET /get_load"]
# Requests per generation mode (positive and negative) and endpoint, in CI.
CI_EXAMPLES = {"POST /v1/completions": 20, "POST /v1/chat/completions": 20, "POST /tokenize": 40,
               "POST /detokenize": 40, "GET /v1/models/{model}": 40,
               "GET /kv/requests/{request_id}": 20, "POST /v1/messages": 20, "POST /v1/messages/count_tokens": 20,
               "POST /v1/responses": 20, "GET /v1/responses/{response_id}": 10,
               "DELETE /v1/responses/{response_id}": 10, "GET /v1/responses/{response_id}/input_items": 10}
STATS: dict[str, Counter] = {}


@pytest.fixture(scope="module")
def schema(real_server):
    return schemathesis.openapi.from_url(real_server.url + "/openapi.json")


def test_the_schema_lists_every_route(schema):
    """A new route must be added here (and so get fuzzed)."""
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == set(WITH_INPUTS) | set(WITHOUT_INPUTS)


def keep_small(body, length_keys: tuple[str, ...] = ("max_tokens", "max_completion_tokens")):
    """Cap what makes a generation long (`length_keys`: the route's length fields); keep
    everything else as generated."""
    if not isinstance(body, dict):
        return body
    for key in length_keys:
        value = body.get(key)
        if value is None and (key == length_keys[0] or length_keys[0] not in body):
            body[key] = 2
        elif isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[key] = 2
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[key] = 2
    return body


def repair(body, model: str):
    """Fix what the schema allows but the server refuses (see the module docstring); `model` is
    the served name."""
    if not isinstance(body, dict):
        return body

    def ids(tokens):
        return [abs(t) % 1000 for t in tokens] or [1]

    body["model"] = model
    for key in ("tools", "response_format", "suffix"):
        body.pop(key, None)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt or "x"
    elif isinstance(prompt, list):
        fixed = [ids(p) if isinstance(p, list) else (p or "x") for p in prompt if not isinstance(p, int)]
        body["prompt"] = ids([p for p in prompt if isinstance(p, int)]) if all(
            isinstance(p, int) for p in prompt) else fixed[:4]
    for message in body.get("messages") or []:
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                part["type"] = "text"
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(i): 1.0 for i in ids([len(k) for k in body["logit_bias"]])}
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = ids(body["stop_token_ids"])
    if isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
        body["logprobs"] = min(abs(body["logprobs"]), 5)
    if isinstance(body.get("top_logprobs"), int):
        body["logprobs"], body["top_logprobs"] = True, min(abs(body["top_logprobs"]), 5)
    if not body.get("stream"):
        body.pop("stream_options", None)
    for key in ("seed", "best_of"):
        body.pop(key, None)
    return body


ANTHROPIC_FIELDS = {"model", "messages", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                    "metadata"}


def repair_anthropic(body, model: str):
    """`repair` for /v1/messages*: text blocks, the user's turn last, declared fields only."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k in ANTHROPIC_FIELDS}
    body["model"] = model
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)] or [{"role": "user"}]
    body["messages"] = [{"role": m.get("role") if m.get("role") in ("user", "assistant") else "user",
                         "content": m["content"] if isinstance(m.get("content"), str) and m["content"] else
                         [{"type": "text", "text": "x"}]} for m in messages]
    body["messages"][-1]["role"] = "user"
    if isinstance(body.get("temperature"), (int, float)):
        body["temperature"] = abs(body["temperature"]) % 1
    if isinstance(body.get("stop_sequences"), list):
        body["stop_sequences"] = [s for s in body["stop_sequences"] if s][:4]
    if not isinstance(body.get("metadata"), dict):
        body.pop("metadata", None)
    return body


def check_response(case, response: schemathesis.Response) -> None:
    what = f"{case.operation.label} body={case.body!r:.600} path={case.path_parameters}"
    assert response.status_code < 500, f"{what} -> {response.status_code} {response.text[:500]}"
    anthropic = case.operation.label.startswith("POST /v1/messages")
    if response.status_code >= 400:
        body = response.json()
        keys = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
        assert set(body["error"]) == keys and body["error"]["message"], what
        assert body.get("type") == "error" or not anthropic, what
    elif (response.headers.get("content-type") or [""])[0].startswith("text/event-stream"):
        last = response.text.rstrip("\n").rsplit("\n\n", 1)[-1]
        if anthropic:  # the last event ends the message, or says why it could not
            assert last.startswith(("event: message_stop", "event: error")), f"{what}: unterminated {last[-300:]}"
        elif case.operation.label == "POST /v1/responses":  # Responses streams end without [DONE]
            assert last.startswith(("event: response.completed", "event: response.incomplete",
                                    "event: response.failed")), f"{what}: unterminated {last[-300:]}"
        else:
            assert response.text.endswith("data: [DONE]\n\n"), f"{what}: unterminated stream {response.text[-300:]}"
    elif case.operation.label != "GET /metrics":
        json.loads(response.text)


def fuzz(url: str, schema, label: str, examples: int) -> Counter:
    """Send `examples` generated requests per generation mode to one endpoint; status counts."""
    operation = schema.find_operation_by_label(label)
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if label.startswith("POST") else [])
    stats: Counter = Counter()
    session = requests.Session()
    served = session.get(url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    for mode in modes:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode), fix=st.booleans())
        def run(case, fix):
            if fix and mode is GenerationMode.POSITIVE:
                fix_body = repair_anthropic if label.startswith("POST /v1/messages") else repair
                case.body = fix_body(case.body, served)
                if "model" in (case.path_parameters or {}):
                    case.path_parameters = {"model": served}
            if label in GENERATING:
                case.body = keep_small(case.body, ("max_output_tokens",) if label == "POST /v1/responses"
                                       else ("max_tokens", "max_completion_tokens"))
            t0 = time.monotonic()
            try:
                response = case.call(base_url=url, session=session, timeout=TIMEOUT_S)
            except requests.Timeout:
                raise AssertionError(f"{label}: no answer within {TIMEOUT_S} s (hang) for {case.body!r:.600}")
            stats[response.status_code] += 1
            stats["slowest_ms"] = max(stats["slowest_ms"], int(1000 * (time.monotonic() - t0)))
            check_response(case, response)

        run()
    return stats


def run_fuzz(real_server, schema, per_mode: dict[str, int]) -> None:
    url = real_server.url
    for label, examples in per_mode.items():
        STATS[label] = fuzz(url, schema, label, examples)
    for label in WITHOUT_INPUTS:
        STATS[label] = fuzz(url, schema, label, 1)
    summary = {label: dict(sorted(counts.items(), key=str)) for label, counts in STATS.items()}
    print("\nschema fuzz: requests by status per endpoint\n" + json.dumps(summary, indent=1))
    if os.environ.get("PAGED_SERVE_FUZZ_REPORT"):
        with open(os.environ["PAGED_SERVE_FUZZ_REPORT"], "w") as f:
            json.dump(summary, f, indent=1)
    assert requests.get(url + "/health", timeout=10).status_code == 200
    wait_pool_free(url, timeout=30)


def test_schema_fuzz_ci(real_server, schema):
    run_fuzz(real_server, schema, CI_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_schema_fuzz_full(real_server, schema):
    """500+ generated requests per endpoint with inputs (positive + negative for the POSTs)."""
    per_mode = int(os.environ.get("PAGED_SERVE_SCHEMA_FUZZ", "300"))
    run_fuzz(real_server, schema, {label: per_mode if label.startswith("POST") else 2 * per_mode
                                   for label in WITH_INPUTS})
    for label in WITH_INPUTS:
        total = sum(v for k, v in STATS[label].items() if k != "slowest_ms")
        assert total >= 500, (label, STATS[label])
