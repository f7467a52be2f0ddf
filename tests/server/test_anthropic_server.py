"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the translation into the
chat path on its own, then the routes on the shared real server with the official `anthropic`
SDK (plain, streamed, stop sequences, tools, a tool-result history, structured output), raw SSE
checks of the events' order and fields, the 400s in Anthropic's error shape, and x-api-key.

NOTE: the SDK (2.x) no longer has temperature among create()'s arguments; the tests send it
with extra_body, as a client of an older model would."""

from __future__ import annotations

import json

import httpx
import pydantic
import pytest
import requests
from fastapi.testclient import TestClient

from server.anthropic_api import MessageEvents, message_blocks, stop_reason, to_chat_request
from server.anthropic_protocol import MessagesRequest
from server.chat_output import OutputFormat, answer
from server.errors import OpenAIError
from server.reasoning import think_format
from server.settings import ServerSettings
from server.tools import plan_tools
from tests.server.faulty_engine import FAIL as FAULT
from tests.server.support import post, wait_pool_free

GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(url):
    """The official `anthropic` client on the session's real server (it appends /v1/messages)."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def anthropic_error(resp: httpx.Response, status: int, param: str | None = None) -> str:
    """`resp` is `status` with Anthropic's error body, its message led by `param` if given."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    message = body["error"]["message"]
    if param is not None:
        assert message.startswith(f"{param}: "), message
    return body["error"]["type"]


def sse_frames(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each frame of an Anthropic stream; the name is the data's type."""
    frames = text.split("\n\n")
    assert frames[-1] == "", text[-200:]
    out = []
    for frame in frames[:-1]:
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name, frame
        out.append((name, data))
    return out


# ------------------------------------------------------------------------------ unit tests
def translate(**body):
    return to_chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": ASK, **body}),
                           ServerSettings())


def test_translation_into_the_chat_request():
    chat = translate(system=[{"type": "text", "text": "Be brief."}], stop_sequences=["\n"], top_k=5,
                     temperature=0.5, tools=[WEATHER], tool_choice={"type": "any"},
                     messages=[{"role": "user", "content": "Weather?"},
                               {"role": "assistant", "content": [
                                   {"type": "thinking", "thinking": "hm", "signature": ""},
                                   {"type": "text", "text": "Let me look."},
                                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                    "input": {"city": "Paris"}}]},
                               {"role": "user", "content": [
                                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny",
                                    "is_error": True},
                                   {"type": "text", "text": "And now?"}]}])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant, tool = chat.messages[2], chat.messages[3]
    assert assistant.content == "Let me look." and assistant.tool_calls[0].function.name == "get_weather"
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert (tool.tool_call_id, tool.name, tool.content) == ("toolu_1", "get_weather", "Error: sunny")
    assert chat.tool_choice == "required" and chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert (chat.stop, chat.top_k, chat.temperature, chat.max_tokens) == (["\n"], 5, 0.5, 8)
    named = translate(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = translate(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert structured.response_format["json_schema"]["schema"] == schema
    assert translate(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}


BAD = {  # name: (fields, the param the 400 names)
    "image": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
              "messages.0.content.0.type"),
    "tool-use-from-user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages.0.content.0.type"),
    "block-extra-field": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
                          "messages.0.content.0.x"),
    "field-of-another-type": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "tool_use_id": "t"}]}]}, "messages.0.content.0.tool_use_id"),
    "text-missing": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    "citations": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{}]}]}]},
                  "messages.0.content.0.citations"),
    "image-in-tool-result": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
        "messages.0.content.0.content.0.type"),
    "prefill-trailing-space": ({"messages": ASK + [{"role": "assistant", "content": "Paris is "}]},
                               "messages.1.content"),
    "prefill-empty": ({"messages": ASK + [{"role": "assistant", "content": ""}]}, "messages.1.content"),
    "prefill-tool-use": ({"messages": ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]}, "messages.1.content"),
    "unknown-field": ({"container": "c"}, "container"),
    "server-tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    "tool-choice-type": ({"tool_choice": {"type": "function"}}, "tool_choice.type"),
    "tool-choice-no-name": ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    "thinking-enabled": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    "effort": ({"output_config": {"effort": "high"}}, "output_config.effort"),
    "format-type": ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    "temperature-over-1": ({"temperature": 1.5}, "temperature"),
    "stop-sequences-count": ({"stop_sequences": [str(i) for i in range(17)]}, "stop_sequences"),
    "stop-sequence-length": ({"stop_sequences": ["x" * 257]}, "stop_sequences.0"),
    "empty-stop-sequence": ({"stop_sequences": [""]}, "stop_sequences.0"),
    "service-tier": ({"service_tier": "priority"}, "service_tier"),
}


@pytest.mark.parametrize("name", BAD)
def test_what_cannot_be_translated_is_a_400_naming_the_field(name):
    fields, param = BAD[name]
    with pytest.raises(OpenAIError) as info:
        translate(**fields)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def stream_events(fmt, pieces: list[str], finish_reason: str = "stop", matched=None) -> list[tuple[str, dict]]:
    """The step events of `pieces` streamed through MessageEvents (no start, no finish)."""
    events = MessageEvents("msg_1", "m", fmt)
    text = "".join(f for i, piece in enumerate(pieces)
                   for f in events.step(piece, finish_reason if i == len(pieces) - 1 else None, matched))
    return sse_frames(text)


def joined(frames, index: int, kind: str, key: str) -> str:
    return "".join(d["delta"][key] for n, d in frames if n == "content_block_delta" and d["index"] == index
                   and d["delta"]["type"] == kind)


def test_thinking_then_text_as_blocks():
    """--reasoning-parser: the thinking is a thinking block before the text block, whole or streamed."""
    fmt = OutputFormat(plan_tools(translate()), think_format("qwen3"))
    text = "<think>\nI add.\n</think>\n\nIt is 4."
    reply, finish = answer(fmt, text, "stop")
    assert [b.model_dump() for b in message_blocks(reply)] == [
        {"type": "thinking", "thinking": "I add.", "signature": ""},
        {"type": "text", "text": "It is 4.", "citations": None}]
    frames = stream_events(fmt, [text[i:i + 3] for i in range(0, len(text), 3)])
    starts = [d["content_block"]["type"] for n, d in frames if n == "content_block_start"]
    assert starts == ["thinking", "text"] and [n for n, _ in frames][-1] == "content_block_stop"
    assert joined(frames, 0, "thinking_delta", "thinking") == "I add."
    assert joined(frames, 1, "text_delta", "text") == "It is 4."


def test_hermes_calls_after_text_as_blocks():
    """--tool-call-parser hermes: the text before a <tool_call> block, then a tool_use block."""
    fmt = OutputFormat(plan_tools(translate(tools=[WEATHER])), tool_parser="hermes")
    text = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    reply, finish = answer(fmt, text, "stop")
    blocks = message_blocks(reply)
    assert [b.type for b in blocks] == ["text", "tool_use"] and blocks[1].input == {"city": "Oslo"}
    assert stop_reason(finish, None, True) == ("tool_use", None)
    frames = stream_events(fmt, [text[i:i + 5] for i in range(0, len(text), 5)])
    starts = [d["content_block"] for n, d in frames if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    assert joined(frames, 0, "text_delta", "text") == "Let me look."
    assert json.loads(joined(frames, 1, "input_json_delta", "partial_json")) == {"city": "Oslo"}


def test_stop_reasons():
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("stop", "\n\n", False) == ("stop_sequence", "\n\n")
    assert stop_reason("stop", 2, False) == stop_reason("stop", None, False) == ("end_turn", None)


# ------------------------------------------------------------------------ the real server
def test_create_answers_as_the_chat_route_does(claude, client, model, url):
    """One path: the same greedy answer and prompt tokens as /v1/chat/completions; usage splits
    the prompt into computed and cached tokens; count_tokens counts the same prompt."""
    msg = claude.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=12, messages=ASK, temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.usage.output_tokens == 12
    prompt_tokens = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt_tokens == chat.usage.prompt_tokens
    assert claude.messages.count_tokens(model=model, messages=ASK).input_tokens == prompt_tokens
    wait_pool_free(url)


def test_a_prefill_is_continued_and_the_reply_is_only_the_continuation(claude, model, url):
    """A final assistant message: the prompt ends in its text, so that greedy decoding goes on
    as it did when the model wrote that text itself; the reply holds only what comes after it."""
    whole = claude.messages.create(model=model, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    words = whole.split(" ")
    assert len(words) > 4, whole
    prefill = " ".join(words[:3]).rstrip()
    messages = ASK + [{"role": "assistant", "content": prefill}]
    msg = claude.messages.create(model=model, max_tokens=8, messages=messages, extra_body=GREEDY)
    rest = msg.content[0].text
    assert whole.startswith(prefill + rest) and rest.strip(), (whole, prefill, rest)
    with claude.messages.stream(model=model, max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == rest
    counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert counted < claude.messages.count_tokens(model=model, messages=messages + [
        {"role": "user", "content": "More."}]).input_tokens
    wait_pool_free(url)


def test_stop_reasons_end_turn_and_stop_sequence(claude, model):
    done = claude.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Say hi."}],
                                  extra_body=GREEDY)
    assert done.stop_reason == "end_turn" and done.usage.output_tokens < 200
    text = done.content[0].text
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3] not in text[:i + 2])
    cut = claude.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Say hi."}],
                                 stop_sequences=["never-generated", stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_streaming_with_the_sdk_matches_the_whole_answer(claude, model, url):
    body = dict(model=model, max_tokens=16, system="Answer briefly.", messages=ASK, extra_body=GREEDY)
    whole = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text and len(pieces) > 1
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    wait_pool_free(url)


def test_raw_stream_events_in_order(real_server, model):
    resp = post(real_server, "/v1/messages", {"model": model, "max_tokens": 6, "messages": ASK, "stream": True,
                                              "stop_sequences": ["zzz"], **GREEDY})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(resp.text)
    names = [name for name, _ in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert frames[2][1] == {"type": "content_block_start", "index": 0, "content_block": {
        "type": "text", "text": "", "citations": None}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in frames[3:-3])
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_a_stream_closed_early_frees_its_blocks(url, model):
    body = {"model": model, "max_tokens": 400, "messages": ASK, "stream": True}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines) == "event: message_start"
    wait_pool_free(url)


def test_tool_use_any_and_named_streamed(claude, model, url):
    msg = claude.messages.create(model=model, max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) == {"city"} and msg.stop_reason == "tool_use"
    with claude.messages.stream(model=model, max_tokens=60, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as stream:
        fragments = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    (block,) = final.content
    assert final.stop_reason == "tool_use" and json.loads("".join(fragments)) == block.input
    wait_pool_free(url)


def test_raw_tool_stream_events(real_server, model):
    resp = post(real_server, "/v1/messages", {
        "model": model, "max_tokens": 60, "stream": True, "tools": [WEATHER], "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Rome?"}]})
    frames = sse_frames(resp.text)
    start = next(d for name, d in frames if name == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    deltas = [d["delta"] for name, d in frames if name == "content_block_delta"]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
    assert set(json.loads("".join(d["partial_json"] for d in deltas))) == {"city"}
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_history_with_a_tool_result(claude, model):
    """A call and its result go into the prompt (count_tokens sees the result's text), and the
    request is answered."""
    def history(result: str) -> list:
        return [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]

    short = claude.messages.count_tokens(model=model, tools=[WEATHER], messages=history("sunny"))
    long = claude.messages.count_tokens(model=model, tools=[WEATHER], messages=history("sunny, 25 degrees, dry"))
    assert long.input_tokens > short.input_tokens
    msg = claude.messages.create(model=model, max_tokens=8, tools=[WEATHER], messages=history("sunny"))
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == short.input_tokens
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_structured_output_with_parse(claude, model):
    msg = claude.messages.parse(model=model, max_tokens=60, output_format=Person,
                                messages=[{"role": "user", "content": "Describe a person called Ann."}])
    assert isinstance(msg.parsed_output, Person) and msg.stop_reason == "end_turn"


@pytest.mark.parametrize("body, status, param", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400,
     "tools.0.input_schema"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": ["a"] * 17}, 400, "stop_sequences"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "top_p": 2}, 400, "top_p"),
    ({"max_tokens": 4, "messages": ASK, "model": "nope"}, 404, "model"),
])
def test_errors_are_anthropic_shaped(real_server, model, body, status, param):
    anthropic_error(post(real_server, "/v1/messages", {"model": model, **body}), status, param)


def test_malformed_bodies_and_the_sdk_errors(real_server, claude, model):
    import anthropic

    assert anthropic_error(post(real_server, "/v1/messages", "{"), 400) == "invalid_request_error"
    assert anthropic_error(post(real_server, "/v1/messages/count_tokens", {"model": model}), 400, "messages")
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=model, max_tokens=4, messages=ASK, extra_body={"temperature": 2})
    assert info.value.body["error"]["message"].startswith("temperature: ")
    # the chat route keeps OpenAI's shape
    assert "param" in post(real_server, "/v1/chat/completions", {"model": model, "messages": ASK,
                                                                  "max_tokens": 0}).json()["error"]


def test_a_request_failing_in_the_engine_is_an_anthropic_error(real_server, claude, model, url):
    """The request fails alone (tests/server/faulty_engine.py): a 500 api_error, or an `error`
    event once the stream has started, which the SDK raises; the pool is freed."""
    import anthropic

    ask = [{"role": "user", "content": f"{FAULT} hello"}]
    assert anthropic_error(post(real_server, "/v1/messages", {"model": model, "max_tokens": 4, "messages": ask}),
                           500) == "api_error"
    resp = post(real_server, "/v1/messages", {"model": model, "max_tokens": 4, "messages": ask, "stream": True})
    name, data = sse_frames(resp.text)[-1]
    assert name == "error" and data["error"]["type"] == "api_error" and "log" in data["error"]["message"]
    with pytest.raises(anthropic.APIStatusError):
        with claude.messages.stream(model=model, max_tokens=4, messages=ask) as stream:
            list(stream.text_stream)
    wait_pool_free(url)


# ------------------------------------------------------------------ x-api-key (no engine)
@pytest.fixture(scope="module")
def guarded_app():
    from server.app import create_app
    from server.cli import parse_args

    def never_built():
        raise AssertionError("the engine must not be started by this test")

    return TestClient(create_app(parse_args(["--api-key", "sekret"]).settings, never_built))


def test_x_api_key_is_accepted_beside_bearer(guarded_app):
    ok = [{"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"},
          {"x-api-key": "sekret", "Authorization": "Bearer sekret"}]
    for headers in ok:
        assert guarded_app.get("/version", headers=headers).status_code == 200
    bad = [{}, {"x-api-key": "nope"}, {"x-api-key": "sekret", "Authorization": "Bearer nope"},
           {"x-api-key": "nope", "Authorization": "Bearer sekret"}]
    for headers in bad:
        assert guarded_app.get("/version", headers=headers).status_code == 401
    twice = guarded_app.get("/version", headers=[("x-api-key", "sekret"), ("x-api-key", "sekret")])
    assert twice.status_code == 401 and "once" in twice.json()["error"]["message"]
    # on /v1/messages the 401 is Anthropic's shape
    assert anthropic_error(guarded_app.post("/v1/messages", json={}, headers={"x-api-key": "nope"}),
                           401) == "authentication_error"


def test_an_unknown_method_or_path_under_messages_is_anthropic_shaped(real_server):
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/nope", 404)):
        r = requests.request(method, real_server.url + path, timeout=30)
        assert r.status_code == status, (method, path, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")
        assert set(body["error"]) == {"type", "message"}
    r = requests.get(real_server.url + "/v1/nope", timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
