"""/v1/responses on the session's real server, driven by the official `openai` SDK (text,
streaming, tools, structured output, a stored conversation of three turns) and by raw HTTP (the
event stream's order and fields, a failure in flight, the 400s and 404s in OpenAI's error
shape); and on servers of their own, the store's bounds and its SQLite file across a restart,
and reasoning items with --reasoning-parser."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import REAL_FLAGS, start_server
from tests.server.support import assert_error, post, wait_pool_free

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"


def events_of(text: str) -> list[dict]:
    """The events of a Responses SSE body: `event: <type>` and `data: {json}` per frame, the
    two types equal; no `[DONE]`."""
    frames = text.split("\n\n")
    assert frames[-1] == "", text[-200:]
    events = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):], frame
        events.append(event)
    return events


def test_text_answer_and_usage(client, model):
    r = client.responses.create(model=model, input="Say hello.", instructions="Answer in French.",
                                max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status in ("completed", "incomplete") and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens
    if r.status == "incomplete":
        assert r.usage.output_tokens == 12 and r.incomplete_details.reason == "max_output_tokens"
    # the same prompt as the chat path's, the instructions its system message; the same greedy answer
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}])
    assert chat.usage.prompt_tokens == r.usage.input_tokens and chat.choices[0].message.content == r.output_text


def test_raw_event_stream_order_and_fields(real_server, model):
    url = real_server.url
    body = {"model": model, "input": "Count to five.", "max_output_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = events_of(resp.read().decode())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]  # 8 tokens of counting: cut short
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in events[3:-2])
    text = "".join(e["delta"] for e in deltas)
    assert events[-4]["text"] == text and events[-3]["part"] == {"type": "output_text", "text": text,
                                                                  "annotations": [], "logprobs": []}
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"] == [events[-2]["item"]] and final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 8
    whole = post(real_server, "/v1/responses", {**body, "stream": False}).json()
    assert whole["output"][0]["content"][0]["text"] == text  # greedy: the same answer either way


def test_sdk_stream_of_a_required_call_equals_the_whole_one(client, model):
    kwargs = dict(model=model, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=40,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"} and whole.status == "completed"
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(fragments) == events[-3].arguments == call.arguments
    assert events[-1].response.output[0].name == "get_weather"


def test_a_call_and_its_output_continue_the_conversation(client, model):
    first = client.responses.create(model=model, input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    # by hand: the whole history as input items
    manual = client.responses.create(model=model, input=[{"role": "user", "content": ASK},
                                                         call.model_dump(exclude_none=True), result],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0)
    # stored: only the result after the call's response
    chained = client.responses.create(model=model, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0)
    assert manual.output_text and manual.output[0].type == "message"
    assert chained.output_text == manual.output_text  # the same prompt either way
    assert chained.usage.input_tokens == manual.usage.input_tokens


def test_three_stored_turns_hit_the_prefix_cache(client, model):
    turns, previous = [], None
    for text in ("My name is Ada and I like tea.", "What do I like?", "And what is my name?"):
        r = client.responses.create(model=model, input=text, previous_response_id=previous, max_output_tokens=10,
                                    temperature=0)
        turns.append(r)
        previous = r.id
        assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    for before, after in zip(turns, turns[1:]):
        assert after.previous_response_id == before.id
        # the whole conversation so far is the prompt, and its prefix is served from the cache
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens // 16 * 16 > 0
    client.responses.delete(turns[1].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(turns[1].id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=model, input="Hi", previous_response_id=turns[1].id)
    assert raised.value.body["param"] == "previous_response_id"
    # the third turn was stored whole: it does not need the second
    r = client.responses.create(model=model, input="Thanks.", previous_response_id=turns[2].id, max_output_tokens=2)
    assert r.usage.input_tokens > turns[2].usage.input_tokens


def test_input_items_are_listed_a_page_at_a_time(client, model, real_server):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
             {"role": "user", "content": "And now?"}]
    r = client.responses.create(model=model, input=items, max_output_tokens=2)
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "function_call", "function_call_output",
                                             "message"]
    assert listed.data[1].content[0].text == "Hi" and listed.data[2].call_id == "c1"
    assert listed.data[3].output == "18 C" and not listed.has_more
    assert (listed.first_id, listed.last_id) == (listed.data[0].id, listed.data[-1].id)
    ids = [i.id for i in listed.data]
    assert len(set(ids)) == 5
    newest = client.responses.input_items.list(r.id)  # desc by default
    assert [i.id for i in newest.data] == ids[::-1]
    page = client.responses.input_items.list(r.id, limit=2, order="asc", after=ids[0])
    assert [i.id for i in page.data] == ids[1:3] and page.has_more
    assert [i.id for i in client.responses.input_items.list(r.id, limit=2, order="asc")] == ids  # the SDK pages on
    text = client.responses.create(model=model, input="Hello", max_output_tokens=2)
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hello"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    base = f"/v1/responses/{r.id}/input_items"
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                         ("order=up", "order"), ("after=nope", "after")):
        assert_error(httpx.get(f"{real_server.url}{base}?{query}", timeout=30), 400, param)


def test_store_false_keeps_nothing(client, model):
    r = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


class Person(BaseModel):
    name: str = Field(max_length=12)  # a short name: the answer fits max_output_tokens
    age: int = Field(ge=0, le=99)


def test_structured_output_parses_with_the_sdk(client, model):
    r = client.responses.parse(model=model, input="Invent a person.", text_format=Person, max_output_tokens=40,
                               temperature=0)
    assert isinstance(r.output_parsed, Person), r.output_text
    assert r.text.format.type == "json_schema"
    loose = client.responses.create(model=model, input="A JSON object, please.", max_output_tokens=30,
                                    temperature=0, text={"format": {"type": "json_object"}})
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_a_failure_in_flight_is_response_failed_and_nothing_is_stored(real_server, model):
    body = {"model": model, "input": "FAULT:FAIL Say hello.", "max_output_tokens": 8, "stream": True}
    with httpx.stream("POST", real_server.url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = events_of(resp.read().decode())
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["message"]
    assert httpx.get(f"{real_server.url}/v1/responses/{events[0]['response']['id']}").status_code == 404
    whole = post(real_server, "/v1/responses", {**body, "stream": False})
    assert_error(whole, 500)
    wait_pool_free(real_server.url)


BAD = [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "f"}]}, "input.0.arguments"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "input"),  # context_length_exceeded names the prompt, as chat does
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"instructions": "x" * 1_000_001}, "input"),  # --max-messages-chars counts the whole prompt
    ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),  # --max-messages counts the items
    ({"model": "gpt-4o"}, "model"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p + f"-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_are_4xx_naming_the_field(real_server, model, extra, param):
    resp = post(real_server, "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2, **extra})
    error = assert_error(resp, 404 if param == "model" else 400, param)
    # the chat path's errors name this API's fields in their text too
    assert not re.search(r"(^messages\b|'messages|\bmessages\.\d|max_completion_tokens)", error["message"]), error


def test_unknown_ids_are_404s_in_openais_shape(real_server, model):
    resp = post(real_server, "/v1/responses", {"model": model, "input": "Hi", "previous_response_id": "resp_x" * 10_000})
    error = assert_error(resp, 404, "previous_response_id")
    assert error["type"] == "not_found_error" and len(error["message"]) < 400
    assert_error(httpx.get(real_server.url + "/v1/responses/resp_nope"), 404, "response_id")
    assert_error(httpx.delete(real_server.url + "/v1/responses/resp_nope"), 404, "response_id")
    wait_pool_free(real_server.url)


def test_the_store_is_bounded_and_its_file_outlives_a_restart(tmp_path):
    path = str(tmp_path / "responses.db")
    flags = [*REAL_FLAGS, "--responses-store", path, "--responses-store-max-count", "2"]
    server = start_server(*flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        ids = [client.responses.create(model="SmolLM2-135M-Instruct", input=f"Hi {i}", max_output_tokens=2).id
               for i in range(3)]
        with pytest.raises(openai.NotFoundError):  # the oldest went first
            client.responses.create(model="SmolLM2-135M-Instruct", input="Hi", previous_response_id=ids[0])
        kept = client.responses.retrieve(ids[2]).model_dump()
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    server = start_server(*flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert client.responses.retrieve(ids[2]).model_dump() == kept
        r = client.responses.create(model="SmolLM2-135M-Instruct", input="Again", previous_response_id=ids[1],
                                    max_output_tokens=2)
        assert r.previous_response_id == ids[1]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


# A chatml template that opens the thinking for the model: with --reasoning-parser everything up
# to </think> (all a 135M model writes) is reasoning.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_reasoning_parser_gives_reasoning_items_whole_and_streamed():
    server = start_server(*REAL_FLAGS, "--chat-template", THINKING_TEMPLATE, "--reasoning-parser", "qwen3")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(model="SmolLM2-135M-Instruct", input="What is 2 + 2?", max_output_tokens=8, temperature=0)
        whole = client.responses.create(**kwargs)
        (item,) = whole.output
        assert item.type == "reasoning" and item.summary[0].type == "summary_text" and item.summary[0].text
        chat = client.chat.completions.create(model=kwargs["model"], max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": kwargs["input"]}])
        assert chat.choices[0].message.model_extra["reasoning_content"] == item.summary[0].text
        events = list(client.responses.create(stream=True, **kwargs))
        deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
        assert "".join(deltas) == item.summary[0].text
        assert [e.type for e in events if e.type.startswith("response.reasoning_summary_part")] == [
            "response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]
        assert events[-1].type == f"response.{whole.status}" and events[-1].response.output[0].type == "reasoning"
        # the thinking never closes within 8 tokens: every output token is reasoning
        for usage in (whole.usage, events[-1].response.usage):
            assert usage.output_tokens_details.reasoning_tokens == usage.output_tokens > 0
    finally:
        assert server.stop() == 0, server.log()[-3000:]
