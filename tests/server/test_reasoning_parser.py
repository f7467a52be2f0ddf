"""--reasoning-parser and --tool-call-parser on a running server with Qwen3's own chat template
(tests/families/templates/qwen3.jinja, as llama.cpp ships it): the thinking goes to
reasoning_content (streamed as delta.reasoning_content), chat_template_kwargs reach the
template, and a kwarg that would set apply_chat_template's own arguments is a 400. The answer's
text is fixed by a structured-output regex, so that the real model writes the tags."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import REAL_FLAGS, REPO, start_server

TEMPLATE = REPO / "tests/families/templates/qwen3.jinja"
FORCED = {"structured_outputs": {"regex": r"<think>\nI add two and two\.\n</think>\n\nIt is 4\."}}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server():
    s = start_server(*REAL_FLAGS, "--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3",
                     "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0, s.log()[-3000:]


def chat(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, **body},
                      timeout=120)


def test_thinking_goes_to_reasoning_content(server):
    r = chat(server, max_tokens=64, temperature=0, **FORCED)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I add two and two."
    assert message["content"] == "It is 4."


def test_streamed_thinking_goes_to_delta_reasoning_content(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=64, temperature=0,
                                                stream=True, extra_body=FORCED):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == ("I add two and two.", "It is 4.")


def test_chat_template_kwargs_reach_the_template(server):
    on = chat(server, max_tokens=1)
    off = chat(server, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert on.status_code == off.status_code == 200, off.text
    # with thinking off Qwen3's template opens and closes an empty <think></think> for the model
    assert off.json()["usage"]["prompt_tokens"] > on.json()["usage"]["prompt_tokens"]
    bad = chat(server, max_tokens=1, chat_template_kwargs={"tokenize": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text


def test_tools_reach_qwen3s_template_and_plain_answers_stay_content(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = chat(server, max_tokens=8, temperature=0, tools=tools)
    without = chat(server, max_tokens=8, temperature=0)
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"] + 20
    message = with_tools.json()["choices"][0]["message"]
    assert "<tool_call>" not in (message["content"] or "") or message.get("tool_calls")


def test_anthropic_thinking_disabled_and_tools_reach_the_template(server):
    """/v1/messages renders through the same template: `thinking: disabled` is enable_thinking
    false, and its tools are the template's tools (counted by /v1/messages/count_tokens)."""
    def count(**body) -> int:
        r = httpx.post(server.url + "/v1/messages/count_tokens",
                       json={"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    plain = count()
    assert count(thinking={"type": "disabled"}) > plain
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    assert count(tools=[tool]) > plain + 20
