"""The Responses API's parts that need no server: a reasoning model's output through the chat
path's reader (`answer`, `ChoiceStream` with --reasoning-parser qwen3 and hermes tool calls) into
reasoning, message and function_call items, whole and streamed alike; the translation of input
items; and `ResponseStore`'s bounds and SQLite file."""

from __future__ import annotations

import json
import sqlite3

import pytest

from server.chat_output import ChoiceStream, OutputFormat, answer
from server.cli import parse_args
from server.errors import OpenAIError
from server.protocol import ChatCompletionRequest
from server.reasoning import reasoning_token_count, think_format
from server.responses_api import ResponsesRequest, input_messages, renamed, renamed_param, to_chat
from server.responses_output import output_items
from server.responses_events import ResponseEvents
from server.responses_store import ResponseStore, StoredResponse
from server.tools import plan_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OUTPUT = "<think>\nI should look it up.\n</think>\n\nLet me check.<tool_call>\n" \
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def reasoning_format(tools: bool = True) -> OutputFormat:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                tools=[TOOL] if tools else None)
    return OutputFormat(plan_tools(req), think_format("qwen3"), False, "hermes")


def streamed(text: str, fmt: OutputFormat, finish_reason: str = "stop", step: int = 3,
             max_tool_calls: int | None = None) -> list[dict]:
    req = ResponsesRequest(model="m", input="Hi", max_tool_calls=max_tool_calls)
    events, stream, frames = ResponseEvents("resp_1", req, "m", 0.0), ChoiceStream(fmt), []
    frames += events.start()
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    finish = None
    for i, piece in enumerate(pieces):
        fields, reason = stream.step(piece, finish_reason if i == len(pieces) - 1 else None)
        finish = reason or finish
        frames += events.step(fields)
    frames += events.finish(finish, {"input_tokens": 1})[0]
    return [json.loads(f.split("\ndata: ", 1)[1]) for f in frames]


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_text_and_a_call_become_three_items_whole_and_streamed():
    fmt = reasoning_format()
    message, finish_reason = answer(fmt, OUTPUT, "stop")
    whole = output_items(message)
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["summary"] == [{"type": "summary_text", "text": "I should look it up."}]
    assert whole[1]["content"][0]["text"] == "Let me check."
    assert (whole[2]["name"], json.loads(whole[2]["arguments"])) == ("get_weather", {"city": "Paris"})
    for step in (1, 3, 50):
        events = streamed(OUTPUT, fmt, step=step)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]
        assert final["type"] == "response.completed" and finish_reason == "tool_calls"
        assert without_ids(final["response"]["output"]) == without_ids(whole)
        kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.reasoning_summary_part.added",
                         "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                         "response.output_item.done",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.output_item.added", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
        summary = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
        assert summary == "I should look it up."


def test_max_tool_calls_keeps_the_first_calls_whole_and_streamed():
    fmt = reasoning_format()
    text = "Checking." + "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n'
                                 "</tool_call>" for city in ("Paris", "Rome", "Oslo"))
    message, _ = answer(fmt, text, "stop")
    assert len(message.tool_calls) == 3
    for limit, cities in ((None, ["Paris", "Rome", "Oslo"]), (2, ["Paris", "Rome"]), (1, ["Paris"])):
        whole = output_items(message, max_calls=limit)
        assert [json.loads(i["arguments"])["city"] for i in whole if i["type"] == "function_call"] == cities
        for step in (1, 7, 500):
            events = streamed(text, fmt, step=step, max_tool_calls=limit)
            assert without_ids(events[-1]["response"]["output"]) == without_ids(whole)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            added = [e for e in events if e["type"] == "response.output_item.added"]
            assert [e["output_index"] for e in added] == list(range(len(whole)))
            args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
            assert args == "".join(i["arguments"] for i in whole if i["type"] == "function_call")


@pytest.mark.parametrize("pieces, opened, expected", [
    (["<th", "ink>", "\nHm", "m.</", "thi", "nk>", "\n\nFour", "."], False, 6),  # through the marker
    (["Hm", "m.</think>", "Four"], True, 2),  # the prompt opened it
    (["<think>", "Hmm, let"], False, 2),  # cut short while thinking: all reasoning
    (["Four", "."], False, 0),  # no reasoning part
    (["Four", "</think>"], False, 0),
])
def test_reasoning_tokens_are_counted_through_the_end_of_thinking(pieces, opened, expected):
    ids = list(range(len(pieces)))
    count = reasoning_token_count(think_format("qwen3"), opened, ids, lambda t: "".join(pieces[i] for i in t))
    assert count == expected


def test_a_cut_short_answer_is_incomplete_and_its_item_too():
    events = streamed("<think>\nHmm, let me", reasoning_format(tools=False), finish_reason="length")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["type"] == "reasoning"


def test_an_empty_answer_is_one_empty_message_whole_and_streamed():
    fmt = reasoning_format(tools=False)
    whole = output_items(answer(fmt, "", "stop")[0])
    events = streamed("", fmt)
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole)
    assert [item["type"] for item in whole] == ["message"] and whole[0]["content"][0]["text"] == ""


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "function_call_output", "call_id": "c2", "output": "done"}]
    messages, origins = input_messages(items)
    assert messages == [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "done", "name": "g"}]
    assert origins == ["input.0", "input.1", "input.3", "input.5"]
    chat, conversation, origins = to_chat(ResponsesRequest(model="m", input=items, instructions="sys"),
                                          [{"role": "user", "content": "before"}])
    assert chat.messages[0].role == "system" and chat.messages[1].content == "before"
    assert conversation[0] == {"role": "user", "content": "before"} and len(conversation) == 5
    assert origins[:3] == ["instructions", "previous_response_id", "input.0"]


@pytest.mark.parametrize("param, expected", [
    ("messages", "input"), ("messages.2.tool_call_id", "input.0"), ("messages.0", "instructions"),
    ("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
    ("tools.3.function.parameters", "tools.3.parameters"), ("tools.1.function", "tools.1"),
    ("tools", "tools"), ("temperature", "temperature"), (None, None)])
def test_chat_fields_are_named_as_this_api_names_them(param, expected):
    assert renamed_param(param, ["instructions", "previous_response_id", "input.0"]) == expected


@pytest.mark.parametrize("message, param, expected_message, expected_param", [
    ("Only text content parts are supported, got type 'image_url'.", "messages.2.content",
     "Only text content parts are supported, got type 'image_url'.", "input.0"),
    ("Invalid value for 'messages.2.content': bad.", "messages.2.content", "Invalid value for 'input.0': bad.",
     "input.0"),
    ("messages.2.tool_calls.0 names no tool; messages.0 is fine.", "messages.2.tool_calls",
     "input.0 names no tool; instructions is fine.", "input.0"),
    ("messages may hold at most 2048 messages, got 2049.", "messages",
     "input may hold at most 2048 messages, got 2049.", "input"),
    ("messages holds 9000 tokens in all, more than this server accepts.", "messages",
     "input holds 9000 tokens in all, more than this server accepts.", "input"),
    ("Invalid value for 'tools.1.function.parameters': not a schema.", "tools.1.function.parameters",
     "Invalid value for 'tools.1.parameters': not a schema.", "tools.1.parameters"),
    ("max_completion_tokens must be at most 4096, got 5000.", "max_completion_tokens",
     "max_output_tokens must be at most 4096, got 5000.", "max_output_tokens"),
    ("temperature must be at most 2.", "temperature", "temperature must be at most 2.", "temperature"),
])
def test_chat_errors_name_this_apis_field_in_their_text_too(message, param, expected_message, expected_param):
    error = renamed(OpenAIError(400, message, param=param, code="c"),
                    ["instructions", "previous_response_id", "input.0"])
    assert (error.message, error.param, error.code) == (expected_message, expected_param, "c")


def test_an_unsupported_item_is_a_400_naming_it():
    with pytest.raises(OpenAIError) as raised:
        input_messages([{"role": "user", "content": "x"}, {"type": "computer_call_output"}])
    assert raised.value.status == 400 and raised.value.param == "input.1.type"


def record(size: int) -> StoredResponse:
    return StoredResponse({"id": "x", "pad": "p" * size}, [{"role": "user", "content": "hi"}])


def test_the_store_evicts_the_oldest_past_either_bound():
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(4):
        assert store.put(f"r{i}", record(10))
    assert store.get("r0") is None and store.get("r3").messages == [{"role": "user", "content": "hi"}]
    assert len(store) == 3
    assert store.put("big", record(7_000))  # bytes: everything older goes but the newest fits
    assert store.get("r1") is None and store.get("r3") is not None and store.bytes <= 10_000
    assert not store.put("huge", record(20_000)) and store.get("huge") is None  # larger than the bound
    assert store.delete("r3") and not store.delete("r3") and store.get("r3") is None


def test_the_sqlite_store_outlives_its_process_in_wal_mode(tmp_path):
    path = str(tmp_path / "r.db")
    store = ResponseStore(max_count=10, max_bytes=10**6, path=path)
    for i in range(4):
        store.put(f"r{i}", record(i))
    store.delete("r1")
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again = ResponseStore(max_count=2, max_bytes=10**6, path=path)  # smaller bound: the oldest go
    assert again.get("r0") is None and again.get("r1") is None
    assert again.get("r3").response == {"id": "x", "pad": "ppp"} and len(again) == 2
    again.close()


def test_the_store_flags_and_their_defaults():
    default = parse_args([]).settings
    assert (default.responses_store, default.responses_store_max_count,
            default.responses_store_max_bytes) == (None, 1000, 64 * 1024**2)
    s = parse_args(["--responses-store", "/tmp/r.db", "--responses-store-max-count", "5",
                    "--responses-store-max-bytes", "1MiB"]).settings
    assert (s.responses_store, s.responses_store_max_count, s.responses_store_max_bytes) == ("/tmp/r.db", 5, 1024**2)
