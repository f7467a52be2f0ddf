"""Property test: whatever a client sends, the answer is never a 5xx (and always a JSON body
in OpenAI's error shape when it is an error). Hypothesis builds the bodies from the fields we
accept, with values of every JSON type and extreme numbers.

All against the shared real server (default model), with generations kept a few tokens long
(max_tokens, n, best_of drawn from small values): the protocol layer and sampling both see
what hypothesis makes up. The schema-driven fuzz (schemathesis) is in test_schema_fuzz.py.
"""

from __future__ import annotations

import os

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 5, 20, 2**31, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 0.5, 1.0, -0.5, 1e30, 1e-30]),
    st.text(max_size=12),
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=8)
SAMPLING_FIELDS = ["model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stream",
                   "stream_options", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                   "skip_special_tokens", "user"]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["prompt", "max_tokens", "logprobs", "echo", "suffix"]
CHAT_FIELDS = SAMPLING_FIELDS + ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"]

PROMPTS = st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=5),
                    st.lists(st.text(max_size=8), max_size=3), JSON)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                    "content": st.one_of(st.text(max_size=20), JSON)}), max_size=3),
    JSON,
)


def bodies(fields: list[str], required: str, required_strategy, tiny: bool):
    values = {f: JSON for f in fields}
    values[required] = required_strategy
    if tiny:  # the real engine: every generation stays a few tokens long
        values["max_tokens"] = st.sampled_from([-1, 0, 1, 2, 10**9])  # NOTE: null is the rest of the context
        values["max_completion_tokens"] = st.sampled_from([1, 2, -3])
        values["n"] = st.sampled_from([None, 0, 1, 2, 99, "2"])
        values["best_of"] = st.sampled_from([None, 1, 2, 0])
        values["min_tokens"] = st.sampled_from([0, 1, 2, -1, 10**6])
        values["ignore_eos"] = st.just(False)

    @st.composite
    def build(draw):
        body = {required: draw(values[required])} if draw(st.integers(0, 9)) else {}
        for name in draw(st.lists(st.sampled_from([f for f in fields if f != required]), max_size=6, unique=True)):
            body[name] = draw(values[name])
        if tiny and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2
        return body

    return build()


def check(url: str, path: str, body) -> None:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


# PAGED_SERVE_FUZZ_SCALE=10 for a long run (the default keeps the suite within its time budget).
SCALE = float(os.environ.get("PAGED_SERVE_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=int(40 * SCALE), deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, "prompt", PROMPTS, tiny=True))
def test_fuzz_completions(real_server, model, body):
    check(real_server.url, "/v1/completions", {"model": model, **body})


@FUZZ
@given(body=bodies(CHAT_FIELDS, "messages", MESSAGES, tiny=True))
def test_fuzz_chat(real_server, model, body):
    check(real_server.url, "/v1/chat/completions", {"model": model, **body})
