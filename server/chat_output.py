"""How a chat choice's generated text becomes the answer's message (`answer`) or its stream of
deltas (`ChoiceStream`): the reasoning split off first (`--reasoning-parser`, server/reasoning.py),
then tool calls read from the rest: the whole answer as one JSON call (server/tools.py), or
`<tool_call>` blocks with `--tool-call-parser hermes` (server/hermes_tools.py) when tool_choice is
"auto" ("required" and a named function constrain the answer to the JSON call either way)."""

from __future__ import annotations

from dataclasses import dataclass

from server.hermes_tools import HermesStream
from server.hermes_tools import parse as parse_hermes
from server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCallResponse, ResponseMessage, ToolCallResponse
from server.reasoning import ThinkFormat, ThinkStream
from server.tools import CallStreamer, ToolPlan, may_be_call, new_call_id, parse_tool_call, partial_call

TOOL_CALL_PARSERS = ("json", "hermes")


@dataclass(frozen=True)
class OutputFormat:
    """What a chat request's outputs are read as."""

    plan: ToolPlan
    think: ThinkFormat | None = None  # --reasoning-parser's format
    opened: bool = False  # the prompt left the thinking open (ThinkFormat.opened_by)
    tool_parser: str = "json"  # one of TOOL_CALL_PARSERS

    @property
    def hermes(self) -> bool:
        return self.tool_parser == "hermes" and self.plan.mode == "auto" and self.plan.parses

    @property
    def plain(self) -> bool:
        """Text streams as it comes: no reasoning to split, no calls to read."""
        return self.think is None and not self.plan.parses


def answer(fmt: OutputFormat, text: str, finish_reason: str | None) -> tuple[ResponseMessage, str | None]:
    """A finished choice's message and finish_reason. A constrained call cut short keeps the
    engine's finish_reason ("length") and the arguments so far, as OpenAI answers a truncated
    call (and as the stream of it showed)."""
    reasoning = None
    if fmt.think is not None:
        reasoning, text = fmt.think.split(text, fmt.opened)
    plan = fmt.plan
    if fmt.hermes:
        content, calls = parse_hermes(text, plan.names)
        if not calls:
            return ResponseMessage(content=text, reasoning_content=reasoning), finish_reason
        tool_calls = [ToolCallResponse(id=new_call_id(), function=FunctionCallResponse(name=n, arguments=a))
                      for n, a in calls]
        return (ResponseMessage(content=content or None, tool_calls=tool_calls, reasoning_content=reasoning),
                plan.finish_reason)
    call = parse_tool_call(text, plan.names) if plan.parses else None
    if call is not None:
        finish_reason = plan.finish_reason
    elif plan.guided is not None:
        call = partial_call(text, plan.names)
    if call is None:
        return ResponseMessage(content=text, reasoning_content=reasoning), finish_reason
    tool_call = ToolCallResponse(id=new_call_id(), function=FunctionCallResponse(name=call[0], arguments=call[1]))
    return ResponseMessage(content=None, tool_calls=[tool_call], reasoning_content=reasoning), finish_reason


class ChoiceStream:
    """One streamed choice: `step(text, finish_reason)` gives the DeltaMessage fields for this
    delta of generated text and the choice's finish_reason.

    Reasoning goes out as `reasoning_content` as it comes. Of the rest: JSON calls constrained
    ("required" / named) send the call's id and name once known, then argument fragments
    (`CallStreamer`); "auto" holds text back while it could still be a whole JSON call (it
    starts with `{` or a fence) and streams it as content once it cannot, parsing what it held
    at the end; hermes streams the text around `<tool_call>` blocks as content and each block
    as one tool-call delta when it closes."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self.think = ThinkStream(fmt.think, fmt.opened) if fmt.think is not None else None
        plan = fmt.plan
        self.calls = CallStreamer(plan.names) if plan.guided is not None else None
        self.hermes = HermesStream(plan.names) if fmt.hermes else None
        self.held = ""
        self.content = False  # "auto" JSON: known to be plain text
        self.made_call = False

    def step(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        fields: dict = {}
        if self.think is not None:
            reasoning, text = self.think.feed(text)
            if finish_reason is not None:
                more_reasoning, more_text = self.think.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                fields["reasoning_content"] = reasoning
        if not self.fmt.plan.parses:
            if text:
                fields["content"] = text
            return fields, finish_reason
        if self.hermes is not None:
            more, finish_reason = self._hermes(text, finish_reason)
        elif self.calls is not None:
            more, finish_reason = self._constrained(text, finish_reason)
        else:
            more, finish_reason = self._auto_json(text, finish_reason)
        return fields | more, finish_reason

    def _hermes(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        stream = self.hermes
        first = stream.calls
        content, calls = stream.feed(text)
        if finish_reason is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        fields: dict = {}
        if content:
            fields["content"] = content
        if calls:
            self.made_call = True
            fields["tool_calls"] = [_delta_call(a, name=n, index=first + i) for i, (n, a) in enumerate(calls)]
        if finish_reason is not None and self.made_call:
            finish_reason = self.fmt.plan.finish_reason
        return fields, finish_reason

    def _auto_json(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        plan = self.fmt.plan
        if self.content:
            return ({"content": text} if text else {}), finish_reason
        self.held += text
        if finish_reason is None:
            if may_be_call(self.held):
                return {}, None
            self.content, held, self.held = True, self.held, ""
            return ({"content": held} if held else {}), None
        call = parse_tool_call(self.held, plan.names)
        if call is None:
            return ({"content": self.held} if self.held else {}), finish_reason
        return {"tool_calls": [_delta_call(call[1], name=call[0])]}, plan.finish_reason

    def _constrained(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls, plan = self.calls, self.fmt.plan
        announced = calls.name is not None
        name, fragment = calls.feed(text)
        deltas = [_delta_call(fragment, name=name)] if name else ([_delta_call(fragment)] if fragment else [])
        if finish_reason is None:
            return ({"tool_calls": deltas} if deltas else {}), None
        call, rest = calls.finish()
        if calls.name is not None:
            if rest:
                if deltas:
                    deltas[0].function.arguments += rest
                else:
                    deltas.append(_delta_call(rest))
            return ({"tool_calls": deltas} if deltas else {}), (plan.finish_reason if call else finish_reason)
        if call is not None:  # a call whose head the streamer could not read (not expected)
            return {"tool_calls": [_delta_call(call[1], name=call[0])]}, plan.finish_reason
        assert not announced
        return ({"content": calls.text} if calls.text else {}), finish_reason


def _delta_call(arguments: str, name: str | None = None, index: int = 0) -> DeltaToolCall:
    if name is None:
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))
    return DeltaToolCall(index=index, id=new_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=arguments))
