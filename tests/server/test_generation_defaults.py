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
from server.sampling import chat_params, completion_params
from server.settings import ServerSettings
from tests.server.conftest import start_server

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.0,
                     "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_new_tokens": 5}
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
    beams = completion_params(CompletionRequest(model="m", prompt="hi", use_beam_search=True, n=2),
                              settings, 1000, {"temperature": 0.8})
    assert beams.temperature == 0.0  # beam search is greedy whatever the defaults


def test_the_daemon_applies_logs_and_shows_the_model_defaults(local_dir):
    server = start_server("--model", str(local_dir), "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                          "--seed", "0", "--disable-uvicorn-access-log")
    try:
        card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        assert card["id"] == "SmolLM2-local"
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
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_missing_path_stops_the_daemon_before_loading(tmp_path):
    server = start_server("--generation-config", str(tmp_path / "nowhere"), wait_healthy=False)
    assert server.proc.wait(60) != 0
    assert "--generation-config" in server.log()
