"""The prompt's logprobs over HTTP, with the `openai` client against the session's real server
(prefix caching on): `echo=True, logprobs=k` answers the echoed prompt tokens with their
logprobs ([None, floats...]), streaming and not, and the vLLM extra `prompt_logprobs` is
capped like logprobs. Short generations: 2 CPU cores."""

from __future__ import annotations

import pytest

from tests.server.support import assert_error, post, wait_pool_free

PROMPT = "A lighthouse keeper wrote in the logbook that the storm"
N_TOK = 3


def n_prompt_tokens(real_server, prompt=PROMPT) -> int:
    return post(real_server, "/tokenize", {"prompt": prompt}).json()["count"]


def assert_echoed(lp, text: str, n_prompt: int, k: int, k_prompt: int | None = None) -> None:
    """Logprobs of an echoed choice: the prompt's n_prompt tokens first ([None, floats...]),
    then the generated ones; tokens spell the text; offsets follow the tokens."""
    k_prompt = k if k_prompt is None else k_prompt
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == text
    for i in range(1, len(lp.tokens)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        limit = k_prompt if i < n_prompt else k
        assert limit <= len(top) <= limit + 1, (i, top)
        assert lp.tokens[i] in top and top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])


def test_echo_with_logprobs(real_server, client, model):
    n_prompt = n_prompt_tokens(real_server)
    assert n_prompt > 3
    answers = []
    for _ in range(2):  # NOTE: the second finds the prompt in the prefix cache; it still scores it whole
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                        logprobs=2)
        choice = out.choices[0]
        assert choice.text.startswith(PROMPT) and out.usage.prompt_tokens == n_prompt
        assert_echoed(choice.logprobs, choice.text, n_prompt, 2)
        assert choice.logprobs.text_offset[n_prompt] == len(PROMPT)
        answers.append(choice.logprobs.token_logprobs)
    assert answers[1] == pytest.approx(answers[0], abs=1e-4)
    wait_pool_free(real_server.url)


def test_echo_with_logprobs_streaming(real_server, client, model):
    n_prompt = n_prompt_tokens(real_server)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                      logprobs=2)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                       logprobs=2, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert len(chunks[0].logprobs.tokens) >= n_prompt  # the prompt's logprobs come with the first chunk
    merged = type(chunks[0].logprobs)(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for c in chunks:
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(merged, field).extend(getattr(c.logprobs, field))
    text = "".join(c.text for c in chunks)
    assert text == whole.choices[0].text
    assert_echoed(merged, text, n_prompt, 2)
    assert merged.token_logprobs[:n_prompt] == pytest.approx(whole.choices[0].logprobs.token_logprobs[:n_prompt],
                                                             abs=1e-4)
    wait_pool_free(real_server.url)


def test_token_id_prompt_and_n2(real_server, client, model):
    ids = post(real_server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(model=model, prompt=ids, max_tokens=N_TOK, temperature=0.8, seed=1, n=2,
                                    echo=True, logprobs=1)
    assert len(out.choices) == 2
    heads = []
    for choice in out.choices:
        assert choice.text.startswith(PROMPT)
        assert_echoed(choice.logprobs, choice.text, len(ids), 1)
        heads.append(choice.logprobs.token_logprobs[: len(ids)])
    assert heads[0] == heads[1]  # both samples share the prompt's logprobs
    wait_pool_free(real_server.url)


def test_prompt_logprobs_extra_field(real_server, client, model):
    n_prompt = n_prompt_tokens(real_server)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                    logprobs=1, extra_body={"prompt_logprobs": 4})
    assert_echoed(out.choices[0].logprobs, out.choices[0].text, n_prompt, 1, k_prompt=4)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1}
    error = assert_error(post(real_server, "/v1/completions", {**body, "prompt_logprobs": 21}), 400, "prompt_logprobs")
    assert "20" in error["message"]
    assert_error(post(real_server, "/v1/completions", {**body, "prompt_logprobs": -1}), 400, "prompt_logprobs")
    assert_error(post(real_server, "/v1/completions", {**body, "logprobs": 21}), 400, "logprobs")
    error = assert_error(post(real_server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1,
                                                               "prompt_logprobs": 2}), 400, "prompt_logprobs")
    assert "echo" in error["message"]
    wait_pool_free(real_server.url)
