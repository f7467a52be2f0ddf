"""The Hermes / Qwen tool-call format (`--tool-call-parser hermes`): the model writes each call
as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in its answer and as
many as it likes (Qwen2.5/3, Hermes 2/3, SmolLM3 templates ask for it). Each such block that
parses as a call to a known tool becomes a `tool_calls` entry; the text around the blocks stays
`content`. A block that does not parse stays text, as vLLM's hermes parser leaves it.
"""

from __future__ import annotations

import json

from server.reasoning import tag_prefix_len

START, END = "<tool_call>", "</tool_call>"


def parse_block(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one block's body, or None unless it is a call to
    one of `names` with an object (or absent) `arguments`."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments already serialised
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def parse(text: str, names: frozenset[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole answer; content is the text outside the parsed blocks,
    stripped. Linear in the text."""
    stream = HermesStream(names)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return (content + rest).strip(), calls + more


class HermesStream:
    """One streamed choice: `feed(delta)` returns (content to send now, calls completed now);
    `finish()` the rest. Text that may be the start of `<tool_call>` is held back; a block is
    held whole until its end tag, and a block still open at the end is content."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.held = ""
        self.inside = False
        self.calls = 0  # calls sent so far (their index in tool_calls)

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        self.held += text
        content, calls = "", []
        while True:
            if self.inside:
                body, sep, rest = self.held.partition(END)
                if not sep:
                    return content, calls
                call = parse_block(body.strip(), self.names)
                if call is None:
                    content += START + body + END
                else:
                    calls.append(call)
                    self.calls += 1
                self.held, self.inside = rest, False
                continue
            head, sep, rest = self.held.partition(START)
            if sep:
                content += head
                self.held, self.inside = rest, True
                continue
            keep = tag_prefix_len(self.held, START)
            content += self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        held, self.held = self.held, ""
        return (START + held if self.inside else held), []

