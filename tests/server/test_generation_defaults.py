"""Sampling defaults from a model's generation_config.json (--generation-config auto|vllm|PATH),
against a local HF directory fixture: the default model's converted directory plus a
generation_config.json, served for real."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server.generation_defaults import load_generation_defaults
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling import chat_params, completion_params, max_tokens_defaulted
from server.settings import ServerSettings
from tests.server.conftest import start_server
from tests.server.support import assert_error

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.0,
                     "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_new_tokens": 5}
MODEL = "SmolLM2-local"  # the served name of `local_dir`
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_tokens": 5}


@pytest.fixture(scope="module")
def local_dir(model_dir, tmp_path_factory) -> Path:
    """A local HF directory: the default model's converted files (linked) and a
    generation_config.json."""
    source = Path(model_dir)
    target = tmp_path_factory.mktemp("models") / "SmolLM2-local"
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).symlink_to(f)
    (target / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return target


def test_auto_vllm_and_a_path(local_dir, tmp_path):
    assert load_generation_defaults("auto", str(local_dir)) == (DEFAULTS, str(local_dir / "generation_config.json"))
    assert load_generation_defaults("vllm", str(local_dir)) == ({}, None)
    assert load_generation_defaults("auto", str(tmp_path)) == ({}, None)  # ships none
    other = tmp_path / "gen.json"
    other.write_text(json.dumps({"temperature": 0.3, "top_p": None, "max_length": 99}))
    assert load_generation_defaults(str(other), str(local_dir)) == ({"temperature": 0.3}, str(other))
    assert load_generation_defaults(str(local_dir), "unused")[0] == DEFAULTS


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"), ("[1]", "JSON object"), ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"), ('{"max_new_tokens": 0}', "max_tokens"),
])
def test_bad_files_are_refused_at_start_up(tmp_path, content, message):
    bad = tmp_path / "generation_config.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(str(tmp_path), "unused")
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path / "missing"), "unused")


def test_defaults_fill_only_what_a_request_leaves_out():
    settings = ServerSettings()
    omitted = completion_params(CompletionRequest(model="m", prompt="hi"), settings, 1000, DEFAULTS)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty,
            omitted.max_tokens) == (0.0, 0.9, 40, 1.1, 5)
    given = completion_params(CompletionRequest(model="m", prompt="hi", temperature=0.7, top_k=3, max_tokens=9),
                              settings, 1000, DEFAULTS)
    assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0.7, 0.9, 3, 9)
    without = completion_params(CompletionRequest(model="m", prompt="hi"), settings, 1000, {})
    assert (without.temperature, without.top_p, without.max_tokens) == (1.0, 1.0, 16)  # OpenAI's defaults
    chat = chat_params(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]),
                       settings, 1000, None, DEFAULTS)
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.0, 40, 5)
    capped = completion_params(CompletionRequest(model="m", prompt="hi"), ServerSettings(max_tokens_limit=3),
                               1000, DEFAULTS)
    assert capped.max_tokens == 3
    # Which requests leave max_tokens to the server (capped at the context left, not a 400).
    assert max_tokens_defaulted(CompletionRequest(model="m", prompt="hi"))  # OpenAI's 16
    assert max_tokens_defaulted(CompletionRequest(model="m", prompt="hi", max_tokens=None))
    assert not max_tokens_defaulted(CompletionRequest(model="m", prompt="hi", max_tokens=16))
    hi = [{"role": "user", "content": "hi"}]
    assert max_tokens_defaulted(ChatCompletionRequest(model="m", messages=hi))
    assert not max_tokens_defaulted(ChatCompletionRequest(model="m", messages=hi, max_tokens=5))
    assert not max_tokens_defaulted(ChatCompletionRequest(model="m", messages=hi, max_completion_tokens=5))
    beams = completion_params(CompletionRequest(model="m", prompt="hi", use_beam_search=True, n=2),
                              settings, 1000, {"temperature": 0.8})
    assert beams.temperature == 0.0  # beam search is greedy whatever the defaults


@pytest.fixture(scope="module")
def daemon(local_dir):
    """The server on the local directory: its generation_config.json in force (max_tokens 5)."""
    server = start_server("--model", str(local_dir), "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                          "--seed", "0", "--disable-uvicorn-access-log")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_the_daemon_applies_logs_and_shows_the_model_defaults(daemon, local_dir):
    server = daemon
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL
    assert card["generation_defaults"] == DEFAULTS
    assert card["generation_config"] == str(local_dir / "generation_config.json")
    assert "Generation defaults from" in server.log() and "max_tokens=5" in server.log()

    def complete(**fields):
        body = {"model": card["id"], "prompt": "The capital of France is", **fields}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    # Left out: the model's greedy temperature, its penalties and max_new_tokens.
    a, b = complete(), complete()
    assert a["usage"]["completion_tokens"] == 5 and a["choices"][0]["text"] == b["choices"][0]["text"]
    same = complete(temperature=0.0, top_p=0.9, top_k=40, repetition_penalty=1.1, max_tokens=5)
    assert same["choices"][0]["text"] == a["choices"][0]["text"]
    # Given: the request's own values win.
    assert complete(max_tokens=8, ignore_eos=True)["usage"]["completion_tokens"] == 8


def _chat_of(server, n_tokens: int) -> list[dict]:
    """Messages whose rendered chat prompt is exactly `n_tokens` tokens (measured by /tokenize)."""
    words = n_tokens
    for _ in range(6):
        messages = [{"role": "user", "content": " hello" * words}]
        body = {"model": MODEL, "messages": messages}
        count = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]
        if count == n_tokens:
            return messages
        words += n_tokens - count
    raise AssertionError(f"no chat prompt of {n_tokens} tokens")


def test_a_default_max_tokens_is_capped_at_the_room_left_in_the_context(daemon):
    """The model's max_new_tokens (5) with a prompt 2 tokens short of the 512-token context: the
    default is capped at those 2 (vLLM's behaviour), where an explicit 5 is still a 400, and a
    prompt that fills the context is a 400 whatever the request asks."""
    long_ids = [1000] * 510

    def completion(prompt, **fields):
        return httpx.post(daemon.url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True, **fields})

    r = completion(long_ids)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and r.json()["choices"][0]["finish_reason"] == "length"
    # Each prompt of a request gets its own room: the short one keeps the whole default.
    both = completion([long_ids, [1000] * 10], logprobs=0).json()
    assert [len(c["logprobs"]["tokens"]) for c in both["choices"]] == [2, 5]
    assert both["usage"]["completion_tokens"] == 7
    err = assert_error(completion(long_ids, max_tokens=5), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "512 tokens" in err["message"]
    assert assert_error(completion([1000] * 512), 400, "prompt")["code"] == "context_length_exceeded"

    messages = _chat_of(daemon, 510)

    def chat(**fields):
        return httpx.post(daemon.url + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": messages, "temperature": 0, "ignore_eos": True, **fields})

    r = chat()
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (510, 2)
    for explicit in ({"max_tokens": 5}, {"max_completion_tokens": 5}):
        assert assert_error(chat(**explicit), 400, "messages")["code"] == "context_length_exceeded"
    assert assert_error(httpx.post(daemon.url + "/v1/chat/completions", timeout=120,
                                   json={"model": MODEL, "messages": _chat_of(daemon, 512)}), 400, "messages")["code"] \
        == "context_length_exceeded"


def test_a_missing_path_stops_the_daemon_before_loading(tmp_path):
    server = start_server("--generation-config", str(tmp_path / "nowhere"), wait_healthy=False)
    assert server.proc.wait(60) != 0
    assert "--generation-config" in server.log()
