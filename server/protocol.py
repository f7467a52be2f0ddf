"""The OpenAI wire protocol as pydantic models: what clients send and what we answer.

Requests accept OpenAI's fields and vLLM's extras (top_k, min_p, ...); unknown fields are
ignored, as vLLM does, so SDK clients that send newer fields keep working. Values are checked
for type here and for range when the `SamplingParams` is built (see `server/sampling.py`).
Responses follow OpenAI's shapes field for field.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from itertools import chain, count
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------- JSON values
class JsonValueError(ValueError):
    """A parsed JSON value that is not one we take (see `check_json_value`)."""


class JsonTooDeep(JsonValueError):
    pass


def check_json_value(value: Any, max_depth: int) -> None:
    """Raise JsonTooDeep if `value` nests arrays and objects more than `max_depth` levels (a
    scalar is 0 levels, `[]` 1), JsonValueError for what Python's json lets through but JSON is
    not: a non-finite number (what 1e400 parses to), a string or key with a lone UTF-16 surrogate
    (\\ud800). Iterative (no recursion limit to hit) and linear in the size of `value`.

    NOTE: one level at a time, each with a few passes that run in C (map, join, chain), rather
    than a walk that visits each value in Python: a 4 MiB body holds a million values."""
    level = [value]
    for depth in count():
        kinds = set(map(type, level))
        if str in kinds:
            _check_string("".join([v for v in level if type(v) is str]))
        if float in kinds and not all(map(math.isfinite, [v for v in level if type(v) is float])):
            raise JsonValueError("numbers must be finite and within the range of a double")
        dicts = [v for v in level if type(v) is dict] if dict in kinds else []
        lists = [v for v in level if type(v) is list] if list in kinds else []
        if not (dicts or lists):
            return
        if depth >= max_depth:
            raise JsonTooDeep(f"arrays and objects nest more than {max_depth} levels deep")
        _check_string("".join(chain.from_iterable(dicts)))  # the keys
        level = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))


def _check_string(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonValueError("a string holds a lone UTF-16 surrogate (such as \\ud800)") from None


class _Request(BaseModel):
    # NOTE: Python's json accepts NaN and Infinity; a NaN temperature would poison a whole batch.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# NOTE: every list and dict of a request stops validating at its first bad item: otherwise a
# 4 MiB body of bad items makes a million validation errors (seconds of the event loop) for an
# answer that shows one.
_FAIL_FAST = Field(fail_fast=True)
Strs = Annotated[list[str], _FAIL_FAST]
Ints = Annotated[list[int], _FAIL_FAST]


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str  # required, as OpenAI has it (/tokenize and /detokenize keep it optional)
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, Strs, None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], _FAIL_FAST] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Ints | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's beam search extras: the beam width is best_of (or n).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's extras.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: Strs | None = None
    guided_grammar: str | None = None


PromptInput = Union[str, Strs, Ints, Annotated[list[Ints], _FAIL_FAST]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    # vLLM's extra: alternatives per echoed prompt token (default: logprobs); needs echo and logprobs.
    prompt_logprobs: int | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


# The deepest nesting of a past tool call's arguments given as a JSON string (the default
# --max-json-depth; the body check does not look inside strings).
MAX_ARGUMENTS_DEPTH = 64


class FunctionCall(_Request):
    name: str
    # NOTE: OpenAI sends a JSON string; an object is accepted too (some clients send one).
    arguments: Union[str, dict[str, Any]] = "{}"

    @field_validator("arguments")
    @classmethod
    def _arguments_nest_within_bounds(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        """The chat template gets the arguments string parsed where it parses: it must not nest so
        deep that parsing (or rendering) hits the recursion limit. Text that is not JSON stays text."""
        if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
            try:
                check_json_value(json.loads(value), MAX_ARGUMENTS_DEPTH)
            except (RecursionError, JsonTooDeep):
                raise ValueError(f"the arguments nest arrays and objects more than {MAX_ARGUMENTS_DEPTH} "
                                 "levels deep") from None
            except ValueError:  # not JSON (JsonValueError: NaN or 1e400, which the template may take)
                pass
        return value


class ToolCall(_Request):
    """A past tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[list[TextPart], _FAIL_FAST], None] = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], _FAIL_FAST] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Tool calling (server/tools.py). tool_choice defaults to "auto" when tools are given.
    tools: Annotated[list[ChatTool], _FAIL_FAST] | None = None
    # NOTE: "none" | "auto" | "required" | NamedToolChoice, checked in server/tools.py so that
    # a bad value is a 400 with param "tool_choice" (not a path through the union's members).
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None  # accepted; each choice makes at most one call
    # extra variables for the chat template (e.g. {"enable_thinking": false}); checked in
    # server/input_processor.py (names the template's own arguments cannot be overridden)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], _FAIL_FAST] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Ints


# ----------------------------------------------------------------------------------- responses
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallResponse(_Response):
    name: str
    arguments: str  # a JSON object, serialised


class ToolCallResponse(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


def _omit_if_none():
    """A field left out of the JSON while None (OpenAI leaves `tool_calls` out of a message or
    delta that makes no call)."""
    return Field(default=None, exclude_if=lambda v: v is None)


class ResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    # --reasoning-parser: the thinking before the answer (vLLM's and SGLang's field)
    reasoning_content: str | None = _omit_if_none()
    tool_calls: list[ToolCallResponse] | None = _omit_if_none()


class ChatCompletionChoice(_Response):
    index: int
    message: ResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None  # a fragment; the fragments of one call join into its JSON


class DeltaToolCall(_Response):
    index: int  # which call of the choice (always 0: one call per choice)
    id: str | None = None  # first delta of a call only
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = _omit_if_none()
    tool_calls: list[DeltaToolCall] | None = _omit_if_none()


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "paged-serve"
    root: str | None = None
    max_model_len: int
    # The sampling defaults a request that leaves those fields out gets (--generation-config),
    # and the generation_config.json they came from.
    generation_defaults: dict[str, float | int] = {}
    generation_config: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
