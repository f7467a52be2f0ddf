"""Reasoning parsers (`--reasoning-parser`): the thinking text a reasoning model writes before
its answer goes to `message.reasoning_content` (streamed as `delta.reasoning_content`), the rest
to `content`, as vLLM and SGLang answer.

Qwen3 and SmolLM3 write `<think>...</think>` before the answer. The thinking is open when the
output starts with `<think>`, or when the prompt ends with it (templates that open it for the
model); then the text up to the first `</think>` is reasoning (all of it if the output stops
first) and the rest content. An output that never opened it (thinking turned off with
`chat_template_kwargs: {"enable_thinking": false}` puts an empty pair in the prompt) is content
only, streamed as it comes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PARSERS = ("qwen3", "smollm3", "deepseek_r1")


@dataclass(frozen=True)
class ThinkFormat:
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt: str) -> bool:
        """Whether `prompt` (the rendered chat prompt) leaves the thinking open."""
        return prompt.rstrip().endswith(self.start)

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output; `opened`: by the prompt."""
        stripped = text.lstrip()
        if not opened and stripped.startswith(self.start):
            opened, text = True, stripped[len(self.start):]
        if not opened:
            return None, text
        head, sep, tail = text.partition(self.end)
        return head.strip("\n"), tail.lstrip("\n")


def reasoning_token_count(fmt: ThinkFormat, opened: bool, token_ids: list[int],
                          decode: Callable[[list[int]], str]) -> int:
    """How many of a whole output's `token_ids` are its reasoning: the tokens up to and through
    the first end-of-thinking marker, all of them if the output stops thinking first, 0 if it
    has no reasoning part (`split`'s None). `decode`: token ids to text, as the engine decodes.

    NOTE: the marker is found in the decoded prefixes (log2(n) decodes), not as token ids: in a
    model without a special token for it (`</think>` is several tokens in most vocabularies) its
    ids depend on the text around it."""
    text = decode(token_ids)
    if fmt.split(text, opened)[0] is None:
        return 0
    if fmt.end not in text:
        return len(token_ids)
    low, high = 1, len(token_ids)  # the shortest prefix whose text holds the marker
    while low < high:
        middle = (low + high) // 2
        if fmt.end in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


def think_format(name: str) -> ThinkFormat:
    """The format of parser `name` (one of PARSERS); ValueError otherwise."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}; got {name!r}")
    return ThinkFormat()


class ThinkStream:
    """One streamed choice through a `ThinkFormat`: `feed(delta)` returns the (reasoning,
    content) text to send now, `finish()` the rest. Text that may still be a tag is held back
    until the next delta tells. Joined, the pieces equal `ThinkFormat.split` of the whole text."""

    def __init__(self, fmt: ThinkFormat, opened: bool = False) -> None:
        self.fmt = fmt
        self.state = "thinking" if opened else "start"  # start -> thinking -> answer, or start -> answer
        self.held = ""
        self.lead = True  # at the start of a part: newlines next to a tag are dropped, as split does
        self.reasoned = opened  # whether the output has a reasoning part (split's None otherwise)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if self.fmt.start.startswith(stripped):
                    return reasoning, content  # may still be the opening tag: wait
                if stripped.startswith(self.fmt.start):
                    self.held, self.state, self.reasoned = stripped[len(self.fmt.start):], "thinking", True
                else:
                    self.state = "answer"
                    self.lead = False
                continue
            if self.state == "thinking":
                if self.lead:
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        return reasoning, content
                    self.lead = False
                head, sep, tail = self.held.partition(self.fmt.end)
                if sep:
                    reasoning += head.rstrip("\n")
                    self.held, self.state, self.lead = tail, "answer", True
                    continue
                # NOTE: trailing newlines wait too: split drops them if the closing tag follows
                keep = tag_prefix_len(self.held, self.fmt.end)
                safe = self.held[:len(self.held) - keep]
                safe = safe[:len(safe.rstrip("\n"))]
                reasoning += safe
                self.held = self.held[len(safe):]
                return reasoning, content
            if self.lead:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return reasoning, content
                self.lead = False
            content += self.held
            self.held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held.rstrip("\n") if not self.lead else held.strip("\n"), ""
        return "", held


def tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
