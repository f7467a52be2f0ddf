"""Anthropic's Messages API wire protocol as pydantic models: what clients send to /v1/messages
and /v1/messages/count_tokens, and the message we answer.

Requests keep the fields they do not declare (`extra="allow"`) so that server/anthropic_api.py
can refuse each one by name (a 400 naming the field) rather than ignore it: Anthropic's API has
many fields this server cannot act on (images, server tools, thinking budgets, containers), and
ignoring one would change the answer silently. Values are checked for type here, for range and
support in server/anthropic_api.py, and for the server's limits by the chat path they are
translated into (server/sampling.py, server/tools.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# NOTE: every list stops validating at its first bad item (as in server/protocol.py): a 4 MiB
# body of bad items would otherwise make a million validation errors.
_FAIL_FAST = Field(fail_fast=True)


class _Open(BaseModel):
    """A request object whose undeclared fields are kept (in `model_extra`) to be refused by name."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentBlock(_Open):
    """One content block of a message, the system prompt or a tool result: every type's fields,
    all optional; server/anthropic_api.py checks which the block's `type` takes.

    Types understood: "text" (text), "tool_use" (id, name, input: an assistant's past call),
    "tool_result" (tool_use_id, content: a string or text blocks, is_error: the user's answer to a
    call), "thinking" / "redacted_thinking" (an assistant's past thinking: dropped, as Anthropic
    drops the thinking of past turns)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: Union[str, Annotated[list["ContentBlock"], _FAIL_FAST], None] = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: accepted (prefix caching is automatic)
    citations: list[dict[str, Any]] | None = None  # only null or [] is accepted (no citations are made)


class MessageParam(_Open):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[ContentBlock], _FAIL_FAST]]


class ToolParam(_Open):
    """A client tool. Server tools (web search, bash, ...) have another `type` and are refused."""

    name: str
    input_schema: dict[str, Any] | None = None  # required of client tools (checked with the type)
    description: str | None = None
    type: str | None = None  # "custom" or absent
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Open):
    type: str  # "auto" | "any" | "tool" | "none"
    name: str | None = None  # "tool": the tool to call
    disable_parallel_tool_use: bool | None = None  # accepted: a choice makes at most one call


class ThinkingConfig(_Open):
    type: str  # "enabled" | "disabled" | "adaptive"
    budget_tokens: int | None = None


class OutputConfig(_Open):
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}
    effort: str | None = None


class CountTokensRequest(_Open):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1, fail_fast=True)
    system: Union[str, Annotated[list[ContentBlock], _FAIL_FAST], None] = None
    tools: Annotated[list[ToolParam], _FAIL_FAST] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, as Anthropic has it."""

    max_tokens: int
    stop_sequences: Annotated[list[str], _FAIL_FAST] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, not used
    service_tier: str | None = None  # accepted: there is one tier


# ----------------------------------------------------------------------------------- responses
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Response):
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens`
    those served from the prefix cache (their sum is the prompt's length)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> "Usage":
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


class TextBlock(_Response):
    type: Literal["text"] = "text"
    text: str
    citations: list | None = None


class ThinkingBlock(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # NOTE: no signature: the thinking is the model's own text, not encrypted


class ToolUseBlock(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ResponseBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage
