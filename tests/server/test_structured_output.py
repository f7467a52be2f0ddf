"""Structured outputs over HTTP on the real server, with the `openai` client: OpenAI's
response_format (json_object, json_schema) on chat, vLLM's guided_* and structured_outputs
extras on completions, streaming, and 400s that name the bad field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server.support import sse_events, wait_pool_free

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person called Ann as JSON."}]


def test_chat_json_schema(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=48,
                                       response_format=fmt)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_chat_json_object_streamed_equals_whole(client, model):
    kwargs = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=48,
                  response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kwargs).choices[0]
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
             if c.choices]
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)
    assert whole.message.content.startswith("{") and "".join(parts) == whole.message.content


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"regex": "(yes|no)"}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "A" [0-9] [0-9]'}, lambda t: re.fullmatch("A[0-9]{2}", t)),
], ids=["guided_regex", "guided_choice", "structured_outputs", "gbnf"])
def test_completions_vllm_extras(client, model, extra, check):
    r = client.completions.create(model=model, prompt="Answer:", temperature=0.8, seed=1, max_tokens=16, n=2,
                                  extra_body=extra)
    for choice in r.choices:
        assert check(choice.text) and choice.finish_reason == "stop", choice


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "use_beam_search": True, "n": 2, "temperature": 0}, "use_beam_search"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(url, model, body, param):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    wait_pool_free(url)


def test_unsatisfiable_constraint_is_a_400_and_an_in_band_error_when_streaming(url, model):
    # No token holds byte 0xF2.
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, "guided_regex": "\u00e0\U000a8684"}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "cannot be met" in r.json()["error"]["message"]
    events = sse_events(httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60).text)
    assert events[-1] == "[DONE]" and "cannot be met" in events[-2]["error"]["message"]
    wait_pool_free(url)
