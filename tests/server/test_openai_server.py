"""The real daemon on the default model (one subprocess for the session), driven with the
official `openai` client and httpx. Short generations throughout: it runs on 2 CPU cores.
(The session's server loads the engine through tests.server.faulty_engine, which changes
nothing for prompts without a FAULT: marker; greedy output is checked against the offline
engine below.)"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from tests.server.support import block_pool_is_free, wait_pool_free

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
N_TOK = 8


@pytest.fixture(scope="module")
def greedy(client, model):
    """The reference greedy completion of PROMPT (N_TOK tokens, with logprobs)."""
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, logprobs=3)


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def tokenize(url: str, **body) -> list[int]:
    return post(url, "/tokenize", body).json()["tokens"]


def sse_events(text: str) -> list:
    frames = text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", text[-300:]
    events = []
    for frame in frames[:-2]:
        assert frame.startswith("data: {"), frame
        events.append(json.loads(frame[len("data: "):]))
    return events


# ------------------------------------------------------------------------------ endpoints
def test_health_version_models(url, client, model):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/version").json()["version"]
    body = httpx.get(url + "/v1/models").json()
    assert body["object"] == "list"
    card = body["data"][0]
    assert set(card) >= {"id", "object", "created", "owned_by", "max_model_len"}
    assert card["object"] == "model" and card["max_model_len"] == 2048 and card["id"] == model
    assert client.models.retrieve(model).id == model


def test_tokenize_detokenize_roundtrip(url):
    tok = post(url, "/tokenize", {"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    assert post(url, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    chat = post(url, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["count"] > tok["count"]


def test_metrics_and_dashboard(url):
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and "paged_serve:kv_cache_usage_perc" in metrics.text
    m = httpx.get(url + "/kv/blocks").json()
    assert m["num_blocks"] == len(m["blocks"]) > 0
    assert httpx.get(url + "/dashboard").status_code in (200, 404)


# ---------------------------------------------------------------- greedy agreement & usage
def test_greedy_same_across_paths(url, client, model, greedy):
    """Non-streamed text == streamed text == the token-id prompt's text; usage counts agree
    with /tokenize and the logprob token list."""
    text = greedy.choices[0].text
    assert greedy.choices[0].finish_reason == "length"
    prompt_ids = tokenize(url, prompt=PROMPT)
    assert greedy.usage.prompt_tokens == len(prompt_ids)
    assert greedy.usage.completion_tokens == N_TOK == len(greedy.choices[0].logprobs.tokens)
    assert greedy.usage.total_tokens == len(prompt_ids) + N_TOK
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=N_TOK, temperature=0)
    assert by_ids.choices[0].text == text
    assert "".join(greedy.choices[0].logprobs.tokens) == text


def test_greedy_equals_offline_engine(greedy):
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.loop.llm import LLM

    torch.set_num_threads(1)  # as the server runs in these tests (see conftest)

    llm = LLM(max_model_len=256, kv_cache_memory="32MiB")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N_TOK))[0]
    assert out.outputs[0].text == greedy.choices[0].text


def test_chat_equals_completion_of_templated_prompt(url, client, model):
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N_TOK, temperature=0)
    ids = tokenize(url, messages=MESSAGES)
    assert chat.usage.prompt_tokens == len(ids)
    comp = client.completions.create(model=model, prompt=ids, max_tokens=N_TOK, temperature=0)
    assert chat.choices[0].message.content == comp.choices[0].text
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    parts = client.chat.completions.create(
        model=model, max_completion_tokens=N_TOK, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}])
    assert parts.choices[0].message.content == chat.choices[0].message.content


def test_logprobs_top1_is_the_greedy_token(greedy, client, model):
    lp = greedy.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3
        best = max(top, key=top.get)
        assert best == token and math.isclose(top[best], logprob, abs_tol=1e-5) and logprob <= 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_echo(client, model, greedy):
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + greedy.choices[0].text
    with_lp = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, echo=True,
                                        logprobs=1)
    lp = with_lp.choices[0].logprobs
    n_prompt = with_lp.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + N_TOK and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == with_lp.choices[0].text
    assert lp.text_offset[n_prompt] == len(PROMPT)


def test_stop_string_and_length(client, model, greedy):
    text = greedy.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    short = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_stop_token_ids_min_tokens_ignore_eos(url, client, model, greedy):
    ids = tokenize(url, prompt=greedy.choices[0].text)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N_TOK, temperature=0,
                                    extra_body={"stop_token_ids": [ids[2]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens <= 3
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"min_tokens": 6, "ignore_eos": True, "skip_special_tokens": False})
    assert out.usage.completion_tokens == 6


def test_sampling_fields(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.5, user="tester",
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text, "the same seed must give the same sample"
    biased_id = 28  # any token: logit_bias +100 makes greedy pick it every time
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(biased_id): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [out.choices[0].logprobs.tokens[0]] * 3


def test_n_and_best_of(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 12
    best = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, best_of=4, temperature=1.0)
    assert sorted(c.index for c in best.choices) == [0, 1]
    multi = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[0].text == multi.choices[1].text  # greedy: both choices of a prompt agree


def test_beam_search_equals_offline_engine(client, model):
    """vLLM's extra fields reach the engine's beam search; HTTP and offline agree."""
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.loop.llm import LLM

    extra = {"use_beam_search": True, "length_penalty": 0.8, "early_stopping": True}
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, best_of=3,
                                    temperature=0, extra_body=extra)
    assert sorted(c.index for c in out.choices) == [0, 1]
    torch.set_num_threads(1)
    llm = LLM(max_model_len=256, kv_cache_memory="32MiB")
    want = llm.generate(PROMPT, SamplingParams(n=2, best_of=3, temperature=0, max_tokens=6, **extra))[0]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
    bad = client.completions.with_raw_response.create
    with pytest.raises(openai.BadRequestError):
        bad(model=model, prompt=PROMPT, max_tokens=4, n=2, temperature=0.7, extra_body=extra)


def test_stream_framing_usage_and_indexes(url, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = post(url, "/v1/chat/completions", body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    roles, finishes = {}, {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
        assert len({chunk["id"] for chunk in chunks}) == 1
        for choice in chunk["choices"]:
            roles.setdefault(choice["index"], choice["delta"].get("role"))
            assert "tool_calls" not in choice["delta"]  # OpenAI leaves it out when no call is made
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert roles == {0: "assistant", 1: "assistant"} and finishes == {0: "length", 1: "length"}
    plain = sse_events(post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 3,
                                                     "stream": True}).text)
    assert all("usage" not in e for e in plain)


def test_streaming_with_openai_client(client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)
    assert text == again.choices[0].message.content


# --------------------------------------------------------------------------------- errors
def test_errors(url, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4000)
    assert "maximum context length is 2048 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2047)
    assert "This model's maximum context length is 2048 tokens. However, you requested" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    for bad in ({"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": -1}, {"logprobs": 50}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=PROMPT, **bad)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, top_logprobs=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, stream_options={"include_usage": True})
    extreme = {"top_k": 10**12, "temperature": 1e30, "repetition_penalty": 1e30, "seed": -1, "min_p": 1.0}
    for key, value in extreme.items():
        r = post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2, key: value})
        assert r.status_code == 200, (key, r.text)
    for bad in ({"max_tokens": 10**12}, {"stop_token_ids": [10**12]}, {"logit_bias": {str(10**10): 1}},
                {"seed": 2**64}, {"prompt": [10**9]}):
        r = post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2, **bad})
        assert r.status_code == 400, (bad, r.text)
    r = httpx.post(url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------------------- concurrency
def test_32_concurrent_mixed_requests(url, model, greedy):
    expected = greedy.choices[0].text

    async def one(c: httpx.AsyncClient, i: int):
        kind = i % 4
        if kind == 0:
            r = await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N_TOK,
                                                      "temperature": 0})
            return kind, r.json()["choices"][0]["text"]
        if kind == 1:
            r = await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N_TOK,
                                                      "temperature": 0, "stream": True})
            return kind, "".join(e["choices"][0]["text"] for e in sse_events(r.text) if e["choices"])
        if kind == 2:
            r = await c.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 6,
                                                           "n": 2, "temperature": 0.9, "seed": i})
            return kind, [ch["finish_reason"] for ch in r.json()["choices"]]
        r = await c.post("/v1/completions", json={"model": model, "prompt": f"Story {i}:", "max_tokens": 6,
                                                  "temperature": 0.8, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        return kind, sse_events(r.text)[-1]["usage"]["completion_tokens"]

    async def health_probe(c: httpx.AsyncClient, done: asyncio.Event) -> float:
        worst = 0.0
        while not done.is_set():
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.05)
        return worst

    async def run():
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as c:
            done = asyncio.Event()
            probe = asyncio.ensure_future(health_probe(c, done))
            results = await asyncio.gather(*[one(c, i) for i in range(32)])
            done.set()
            return results, await probe

    results, worst_health = asyncio.run(run())
    assert worst_health < 2.0, f"/health took {worst_health:.2f} s while the engine was busy"
    for kind, result in results:
        if kind in (0, 1):
            assert result == expected, "greedy output changed under batching"
        elif kind == 2:
            assert len(result) == 2 and all(result)
        else:
            assert 1 <= result <= 6
    wait_pool_free(url)


def test_disconnect_mid_stream_frees_the_pool(url, model):
    wait_pool_free(url)
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)
        assert not block_pool_is_free(url)
    wait_pool_free(url)
    assert "paged_serve:client_disconnects_total" in httpx.get(url + "/metrics").text


def test_disconnect_non_streaming_frees_the_pool(url, model):
    wait_pool_free(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1000,
                                                  "ignore_eos": True}, timeout=1.5)
    wait_pool_free(url)


def test_developer_role_is_the_system_prompt(url, client, model):
    system = [{"role": "system", "content": "Answer in French."}, *MESSAGES]
    developer = [{"role": "developer", "content": "Answer in French."}, *MESSAGES]
    assert tokenize(url, messages=developer) == tokenize(url, messages=system)
    r = client.chat.completions.create(model=model, messages=developer, max_tokens=2, temperature=0)
    assert r.choices[0].message.content


def test_usage_reports_prefix_cached_prompt_tokens(client, model):
    # A prompt no other test sends: cold the first time, then served from the prefix cache
    # in whole blocks (16 tokens each), the last block always computed.
    prompt = "Usage accounting check: " + " ".join(f"item{i}" for i in range(40))
    cold = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    warm = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < warm.usage.prompt_tokens and cached % 16 == 0
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=model, messages=chat, max_tokens=1, temperature=0)
    again = client.chat.completions.create(model=model, messages=chat, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_plain_chat_message_has_no_tool_calls_key(url, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    message = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert set(message) == {"role", "content"}
