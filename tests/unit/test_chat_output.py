"""Reasoning and Hermes tool-call parsing of chat outputs (server/reasoning.py,
server/hermes_tools.py, server/chat_output.py): whole answers as vLLM's parsers read them, and
streams cut anywhere (seeded random cuts) that join to the whole answer's message."""

from __future__ import annotations

import json
import random

import pytest

from server.chat_output import ChoiceStream, OutputFormat, answer
from server.hermes_tools import parse
from server.reasoning import ThinkFormat, ThinkStream, think_format
from server.tools import ToolPlan

THINK = ThinkFormat()
NAMES = frozenset({"get_weather", "add"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'


@pytest.mark.parametrize("text,opened,want", [
    ("<think>\nLet me add.\n\n</think>\n\nIt is 4.", False, ("Let me add.", "It is 4.")),
    ("It is 4.", False, (None, "It is 4.")),
    ("<think>\n\n</think>\n\nIt is 4.", False, ("", "It is 4.")),
    ("<think>still thinking when cut off", False, ("still thinking when cut off", "")),
    ("Let me add.\n</think>\n\nIt is 4.", True, ("Let me add.", "It is 4.")),  # the prompt opened it
    ("Plain </think> text", False, (None, "Plain </think> text")),  # never opened: all content
])
def test_think_split(text, opened, want):
    assert THINK.split(text, opened) == want


def test_think_format_names_the_parsers():
    assert think_format("qwen3") == think_format("smollm3") == THINK
    with pytest.raises(ValueError, match="reasoning parser must be one of qwen3, smollm3, deepseek_r1"):
        think_format("o1")
    assert THINK.opened_by("<|im_start|>assistant\n<think>\n") and not THINK.opened_by("<|im_start|>assistant\n")


def cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


TEXTS = ["<think>\nLet me add.\n\n</think>\n\nIt is 4.", "It is 4.", "<think>\n\n</think>\n\nHi\n", "  <think>x",
         "<thi", "x</think>y", "\n\nHi\n\n", "<think>a\n\n\nb</think>", "<think></think>\n", "",
         "<think>\nweather?\n</think>\n\n" + CALL, "Sure. " + CALL + "\n" + ADD + " Done.", CALL[:30],
         "<tool_call>not json</tool_call> then text", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>']


def test_think_stream_joins_to_the_split_at_any_cuts():
    rng = random.Random(0)
    for text in TEXTS:
        for opened in (False, True):
            want = THINK.split(text, opened)
            for _ in range(100):
                stream, reasoning, content = ThinkStream(THINK, opened), "", ""
                for part in cuts(text, rng):
                    r, c = stream.feed(part)
                    reasoning, content = reasoning + r, content + c
                r, c = stream.finish()
                got = (reasoning + r if stream.reasoned else None, content + c)
                assert got == want, (text, opened)


def test_hermes_parse():
    assert parse("Sure. " + CALL + "\n" + ADD + " Done.", NAMES) == (
        "Sure. \n Done.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')])
    assert parse("no calls here", NAMES) == ("no calls here", [])
    # unknown tools, bad JSON and an unclosed block stay text
    for text in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>not json</tool_call>",
                 CALL[:40], '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'):
        assert parse(text, NAMES) == (text.strip(), [])


def plan(mode: str = "auto") -> ToolPlan:
    functions = [{"name": n, "parameters": {"type": "object"}} for n in sorted(NAMES)]
    return ToolPlan(functions, mode, None, None, NAMES)


def run_stream(fmt: OutputFormat, text: str, rng: random.Random) -> tuple[dict, str]:
    """The stream's deltas of `text` cut at random, joined: reasoning, content, calls by index."""
    stream = ChoiceStream(fmt)
    parts = cuts(text, rng)
    joined: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
    finish = None
    for k, part in enumerate(parts):
        fields, finish = stream.step(part, "stop" if k == len(parts) - 1 else None)
        joined["reasoning_content"] += fields.get("reasoning_content", "")
        joined["content"] += fields.get("content", "")
        for call in fields.get("tool_calls", []):
            entry = joined["tool_calls"].setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    return joined, finish


@pytest.mark.parametrize("reasoning", [False, True])
def test_chat_stream_joins_to_the_whole_answer(reasoning):
    rng = random.Random(1)
    fmt = OutputFormat(plan(), THINK if reasoning else None, False, "hermes")
    for text in TEXTS:
        message, finish = answer(fmt, text, "stop")
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        for _ in range(50):
            joined, stream_finish = run_stream(fmt, text, rng)
            assert stream_finish == finish, text
            assert list(joined["tool_calls"].values()) == calls, text
            assert joined["reasoning_content"] == (message.reasoning_content or ""), text
            if calls:  # the whole answer strips the text around its calls
                assert joined["content"].strip() == (message.content or ""), text
            else:
                assert joined["content"] == message.content, text
    message, finish = answer(fmt, "<think>\nweather?\n</think>\n\n" + CALL, "stop")
    assert finish == "tool_calls" and message.content == (None if reasoning else "<think>\nweather?\n</think>")
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert message.reasoning_content == ("weather?" if reasoning else None)


def test_without_hermes_a_tool_call_block_is_text_and_json_answers_still_parse():
    fmt = OutputFormat(plan(), None, False, "json")
    message, finish = answer(fmt, CALL, "stop")
    assert message.content == CALL and message.tool_calls is None and finish == "stop"
    message, finish = answer(fmt, '{"name": "add", "arguments": {"a": 1}}', "stop")
    assert message.tool_calls[0].function.name == "add" and finish == "tool_calls"
    assert "reasoning_content" not in message.model_dump()  # left out when no parser set it
