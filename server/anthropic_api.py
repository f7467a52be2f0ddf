"""Anthropic's Messages API <-> the chat path: a Messages request becomes the
`ChatCompletionRequest` that /v1/chat/completions would take (`to_chat_request`), so that it
goes through the same input processing, sampling, tool and structured-output code
(server/admission.py); the chat path's answer (`ResponseMessage`, or `ChoiceStream`'s deltas)
becomes Anthropic's content blocks, stop_reason and stream events (`message_blocks`,
`MessageEvents`).

What translates:
- `system` (a string or text blocks) -> a system message; `messages` -> chat messages: text
  blocks join into one message's content, an assistant's `tool_use` blocks become its
  `tool_calls`, each `tool_result` a tool message (`is_error`: its content prefixed "Error: ").
  An assistant's past `thinking` blocks are dropped, as Anthropic drops past turns' thinking.
  A final assistant message (prefill: text only, no trailing whitespace) is continued: the
  prompt ends in its text (`prefilled`; the template's continue_final_message) and the answer
  holds only the continuation.
- `tools` (client tools: name, description, input_schema) -> function tools; `tool_choice`
  auto / any / tool / none -> "auto" / "required" / the named function / "none".
- `stop_sequences` -> stop; `max_tokens`, `temperature` (0-1, as Anthropic), `top_p`, `top_k`.
- `output_config.format` ({"type": "json_schema", "schema"}) -> a json_schema response_format.
- `thinking: {"type": "disabled"}` -> the template variable enable_thinking=false.
Everything else is a 400 naming the field: other content block types (images, documents,
server tools' blocks), server tools, thinking budgets, output_config.effort, and any field this
server does not know.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from server.anthropic_protocol import (
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    ResponseBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from server.chat_output import ChoiceStream, OutputFormat
from server.errors import bad_request, shown
from server.protocol import ChatCompletionRequest, ChatMessage, ChatTool, FunctionCall, FunctionDefinition, \
    ResponseMessage, ToolCall
from server.settings import ServerSettings

# Fields of a block beside its type's own that any block may carry.
_ANY_BLOCK = {"type", "cache_control", "citations"}
_BLOCK_FIELDS = {"text": {"text"}, "tool_use": {"id", "name", "input"},
                 "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"},
                 "redacted_thinking": {"data"}}
_REQUIRED = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Top-level fields accepted that change nothing here.
_INERT = {"cache_control"}


# ----------------------------------------------------------------------------- the request
def to_chat_request(req: CountTokensRequest, settings: ServerSettings) -> ChatCompletionRequest:
    """The chat request that `req` asks for; raises OpenAIError (400 naming the Anthropic field)
    for what cannot be translated. The server's limits are the chat path's, checked when the
    chat request is admitted; stop_sequences' are checked here, under their own name."""
    _no_extra(req, "", allowed=_INERT)
    messages = _system(req.system) + _messages(req.messages)
    fields: dict[str, Any] = dict(model=req.model, messages=messages, tools=_tools(req.tools),
                                  tool_choice=_tool_choice(req))
    fields.update(_thinking(req))
    fields.update(_output_config(req))
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, top_p=req.top_p, top_k=req.top_k, stream=bool(req.stream),
                      stop=_stop_sequences(req.stop_sequences, settings), temperature=_temperature(req.temperature))
        if req.service_tier not in (None, "auto", "standard_only"):
            raise bad_request('service_tier must be "auto" or "standard_only".', param="service_tier")
        user = (req.metadata or {}).get("user_id")
        fields["user"] = user if isinstance(user, str) else None
    return ChatCompletionRequest(**fields)


def _no_extra(obj: BaseModel, where: str, allowed: Iterable[str] = ()) -> None:
    for name in obj.model_extra or {}:
        if name not in allowed:
            raise bad_request(f"the field {shown(name, 64)!r} is not supported by this server.",
                              param=f"{where}{name}")


def _system(system: str | list[ContentBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    return [ChatMessage(role="system", content=_text_only(system, "system"))]


def _text_only(content: str | list[ContentBlock], where: str) -> str:
    """The text of a string or of text blocks (the system prompt, a tool result's content)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        _check_block(block, f"{where}.{j}", ("text",))
        texts.append(block.text)
    return "\n".join(texts)


def _check_block(block: ContentBlock, where: str, types: tuple[str, ...]) -> None:
    """`block` is of one of `types`, with its type's fields (and only those)."""
    if block.type not in types:
        known = ", ".join(types)
        raise bad_request(f"content blocks of type {shown(block.type, 64)!r} are not supported here (only {known}).",
                          param=f"{where}.type")
    _no_extra(block, f"{where}.")
    foreign = sorted(block.model_fields_set - _ANY_BLOCK - _BLOCK_FIELDS[block.type])
    if foreign:
        raise bad_request(f"a {block.type} block has no field {foreign[0]!r}.", param=f"{where}.{foreign[0]}")
    for name in _REQUIRED.get(block.type, ()):
        if getattr(block, name) is None:
            raise bad_request(f"a {block.type} block needs {name!r}.", param=f"{where}.{name}")
    if block.citations:
        raise bad_request("citations are not supported.", param=f"{where}.citations")


def prefilled(req: CountTokensRequest) -> bool:
    """Whether `req` ends in an assistant message (a prefill): the answer continues its text."""
    return bool(req.messages) and req.messages[-1].role == "assistant"


def _messages(messages: list) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, message in enumerate(messages):
        _no_extra(message, f"messages.{i}.")
        blocks = [ContentBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        if message.role == "assistant":
            out.append(_assistant(blocks, f"messages.{i}.content", names))
            if i == len(messages) - 1:
                _check_prefill(out[-1], f"messages.{i}.content")
        else:
            out += _user(blocks, f"messages.{i}.content", names)
    return out


def _check_prefill(message: ChatMessage, where: str) -> None:
    """A final assistant message is continued, so it must be text that ends where the answer goes on."""
    if message.tool_calls:
        raise bad_request("a final assistant message (prefill) may hold only text: a tool_use is answered by the "
                          "user's tool_result.", param=where)
    if not message.content:
        raise bad_request("a final assistant message (prefill) needs text to continue.", param=where)
    if message.content != message.content.rstrip():
        # NOTE: as Anthropic refuses it; templates may also trim the text, which would then not end the prompt
        raise bad_request("final assistant content cannot end with trailing whitespace.", param=where)


def _assistant(blocks: list[ContentBlock], where: str, names: dict[str, str]) -> ChatMessage:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        _check_block(block, f"{where}.{j}", _ASSISTANT_BLOCKS)
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            try:
                function = FunctionCall(name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))
            except ValidationError as exc:
                raise bad_request(exc.errors()[0]["msg"].removeprefix("Value error, "),
                                  param=f"{where}.{j}.input") from None
            calls.append(ToolCall(id=block.id, function=function))
            names[block.id] = block.name
    return ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)


def _user(blocks: list[ContentBlock], where: str, names: dict[str, str]) -> list[ChatMessage]:
    """A user turn: each tool_result a tool message, the text between them user messages."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        _check_block(block, f"{where}.{j}", _USER_BLOCKS)
        if block.type == "text":
            texts.append(block.text)
            continue
        if texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
            texts = []
        result = _text_only(block.content, f"{where}.{j}.content") if block.content is not None else ""
        if block.is_error:
            result = f"Error: {result}"
        out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id,
                               name=names.get(block.tool_use_id)))
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tools(tools: list | None) -> list[ChatTool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise bad_request(f"server tools ({shown(tool.type, 64)!r}) are not supported: give client tools "
                              "with a name and an input_schema.", param=f"tools.{i}.type")
        _no_extra(tool, f"tools.{i}.")
        if tool.input_schema is None:
            raise bad_request("a tool needs an input_schema.", param=f"tools.{i}.input_schema")
        out.append(ChatTool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                                        parameters=tool.input_schema)))
    return out


def _tool_choice(req: CountTokensRequest) -> str | dict | None:
    choice = req.tool_choice
    if choice is None:
        return None
    _no_extra(choice, "tool_choice.")
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice of type "tool" needs the name of a tool.', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if choice.type not in _TOOL_CHOICES:
        raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none".', param="tool_choice.type")
    if choice.name is not None:
        raise bad_request('only a tool_choice of type "tool" names a tool.', param="tool_choice.name")
    return _TOOL_CHOICES[choice.type]


def _thinking(req: CountTokensRequest) -> dict:
    thinking = req.thinking
    if thinking is None:
        return {}
    _no_extra(thinking, "thinking.")
    if thinking.type != "disabled":
        raise bad_request('only {"type": "disabled"} is supported: a model served with --reasoning-parser thinks '
                          "as its chat template makes it, without a budget, and its thinking comes back as "
                          "thinking blocks.", param="thinking.type")
    if thinking.budget_tokens is not None:
        raise bad_request("budget_tokens goes with thinking enabled.", param="thinking.budget_tokens")
    return {"chat_template_kwargs": {"enable_thinking": False}}


def _output_config(req: CountTokensRequest) -> dict:
    config = req.output_config
    if config is None:
        return {}
    _no_extra(config, "output_config.")
    if config.effort is not None:
        raise bad_request("effort is not supported.", param="output_config.effort")
    fmt = config.format
    if fmt is None:
        return {}
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) or set(fmt) != {"type", "schema"}:
        raise bad_request('format must be {"type": "json_schema", "schema": {...}}.', param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def _stop_sequences(stop: list[str] | None, settings: ServerSettings) -> list[str]:
    stop = stop or []
    if len(stop) > settings.max_stop_sequences:
        raise bad_request(f"stop_sequences may hold at most {settings.max_stop_sequences} sequences, "
                          f"got {len(stop)}.", param="stop_sequences")
    for i, sequence in enumerate(stop):
        if not sequence:
            raise bad_request("each stop sequence must hold at least one character.", param=f"stop_sequences.{i}")
        if len(sequence) > settings.max_stop_str_len:
            raise bad_request(f"each stop sequence may be at most {settings.max_stop_str_len} characters long, "
                              f"got one of {len(sequence)}.", param=f"stop_sequences.{i}")
    return stop


def _temperature(temperature: float | None) -> float | None:
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise bad_request(f"temperature must be between 0 and 1, got {temperature}.", param="temperature")
    return temperature


# ------------------------------------------------------------------------------ the answer
def stop_reason(finish_reason: str | None, matched: str | int | None, made_call: bool
                ) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a choice the chat path finished with `finish_reason`;
    `matched`: the engine's stop_reason (the stop string that ended it, or a stop token id)."""
    if finish_reason == "length":
        return "max_tokens", None
    if made_call:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict:
    """A call's arguments as an object; {} for a call cut short (its stop_reason is "max_tokens")."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_blocks(message: ResponseMessage) -> list[ResponseBlock]:
    """The content blocks of the chat path's answer: thinking, text, then the tool calls."""
    blocks: list[ResponseBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseBlock(id=tool_use_id(call.id), name=call.function.name,
                                   input=_tool_input(call.function.arguments)))
    return blocks


def message(message_id: str, model: str, answer: ResponseMessage, finish_reason: str | None,
            matched: str | int | None, usage: Usage) -> Message:
    """The whole answer of a non-streamed request."""
    blocks = message_blocks(answer)
    reason, sequence = stop_reason(finish_reason, matched, any(b.type == "tool_use" for b in blocks))
    return Message(id=message_id, model=model, content=blocks, stop_reason=reason, stop_sequence=sequence,
                   usage=usage)


def event(name: str, data: dict) -> str:
    """One server-sent event: Anthropic's `event:` line names the type `data` carries too."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class MessageEvents:
    """The events of one streamed message, fed the chat path's deltas of its one choice:
    message_start and a ping (`start`), then per content block content_block_start, its deltas
    (thinking_delta, text_delta, input_json_delta) and content_block_stop (`step`), then
    message_delta with the stop_reason and usage and message_stop (`finish`)."""

    def __init__(self, message_id: str, model: str, fmt: OutputFormat) -> None:
        self.message_id, self.model = message_id, model
        self.choice = ChoiceStream(fmt)
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's type
        self.made_call = False
        self.stop: tuple[StopReason, str | None] | None = None

    def start(self, usage: Usage) -> list[str]:
        start = Message(id=self.message_id, model=self.model, content=[], stop_reason=None, usage=usage)
        return [event("message_start", {"type": "message_start", "message": start.model_dump()}),
                event("ping", {"type": "ping"})]

    def step(self, text: str, finish_reason: str | None, matched: str | int | None) -> list[str]:
        fields, finish_reason = self.choice.step(text, finish_reason)
        out = []
        if fields.get("reasoning_content"):
            out += self._block(ThinkingBlock(thinking=""), same=True)
            out.append(self._delta({"type": "thinking_delta", "thinking": fields["reasoning_content"]}))
        if fields.get("content"):
            out += self._block(TextBlock(text=""), same=True)
            out.append(self._delta({"type": "text_delta", "text": fields["content"]}))
        for call in fields.get("tool_calls") or []:
            if call.id is not None:  # a new call: its block starts
                self.made_call = True
                out += self._block(ToolUseBlock(id=tool_use_id(call.id), name=call.function.name, input={}))
            if call.function.arguments and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        if finish_reason is not None:
            out += self._close()
            self.stop = stop_reason(finish_reason, matched, self.made_call)
        return out

    def finish(self, usage: Usage) -> list[str]:
        reason, sequence = self.stop or ("end_turn", None)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage.model_dump()}
        return [event("message_delta", delta), event("message_stop", {"type": "message_stop"})]

    def _block(self, block: ResponseBlock, same: bool = False) -> list[str]:
        """Start `block` (closing the open one); `same`: continue the open block if of its type."""
        if same and self.open == block.type:
            return []
        out = self._close()
        self.index += 1
        self.open = block.type
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block.model_dump()}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
