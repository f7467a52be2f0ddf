"""OpenAI's Responses API in terms of the chat path: a /v1/responses request becomes a
`ChatCompletionRequest` (`to_chat`), which goes the way every chat request goes
(server/chat_request.py: messages, tools, admission, structured outputs); its chat answer comes
back as Responses output items (server/responses_output.py), or streamed as the events of
server/responses_events.py.

What a request may hold (anything else that would change the answer is a 400 naming it):
- `input`: a string (one user message) or a list of items: messages (`role` user / system /
  developer / assistant; `content` a string or `input_text` / `output_text` parts),
  `function_call` and `function_call_output` items, and `reasoning` items (dropped: chat
  templates leave past thinking out);
- `instructions` (a system message first, not carried on by `previous_response_id`),
  `max_output_tokens`, `temperature`, `top_p`, function `tools`, `tool_choice`,
  `parallel_tool_calls`, `max_tool_calls` (the first that many calls are kept), `text.format`
  (text, json_object, json_schema), `stream`, `store`, `previous_response_id` (its stored
  conversation comes first), `metadata` (stored, answered).
The chat path's errors name chat fields; `renamed` turns them into this API's (`messages.3` is
the input item it came from, `max_completion_tokens` is `max_output_tokens`, ...).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import OpenAIError, bad_request
from server.protocol import ChatCompletionRequest, ChatMessage

MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value characters
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# NOTE: lists stop validating at their first bad item (as server/protocol.py's do).
_Items = Annotated[list[dict[str, Any]], Field(fail_fast=True)]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None  # accepted: the summary is the whole thinking whatever is asked


class ResponsesRequest(_Body):
    """POST /v1/responses. Items of `input` and `tools` are checked one by one in `to_chat`, so
    that an unsupported type is a 400 that names it."""

    model: str
    input: Union[str, _Items]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: _Items | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    max_tool_calls: int | None = None
    # Refused when set (they would change the answer and are not served):
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------ request -> chat
def check_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming the first field set that this server does not serve."""
    if req.background:
        raise bad_request("background responses are not supported; leave background unset or false.",
                          param="background")
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported; send the conversation as input (or previous_response_id).",
                              param=name)
    if req.include:
        raise bad_request("include is not supported: no output item has optional fields to add.", param="include")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses (use /v1/chat/completions).",
                          param="top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise bad_request('truncation must be "disabled": a conversation longer than the context is a 400.',
                          param="truncation")
    if req.max_tool_calls is not None and req.max_tool_calls < 1:
        raise bad_request("max_tool_calls must be at least 1 (the calls past it are left out of the output).",
                          param="max_tool_calls")
    if req.reasoning is not None and req.reasoning.effort is not None:
        raise bad_request("reasoning.effort is not supported: a reasoning model thinks as its template lets it "
                          "(chat_template_kwargs on /v1/chat/completions).", param="reasoning.effort")
    if req.text is not None and req.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported.", param="text.verbosity")
    _check_metadata(req.metadata)


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata may hold at most {MAX_METADATA} pairs, got {len(metadata)}.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata keys may be at most {MAX_METADATA_KEY} characters.", param="metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata values must be strings of at most {MAX_METADATA_VALUE} characters.",
                              param=f"metadata.{key[:MAX_METADATA_KEY]}")


class _InputPart(_Body):
    type: str
    text: str | None = None


_Parts = Annotated[list[_InputPart], Field(fail_fast=True)]


class _InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, _Parts]


class _FunctionCall(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, _Parts]


_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
               "assistant": ("output_text", "input_text", "refusal")}


def input_messages(items: str | list[dict[str, Any]], history: list[dict] = (),
                   param: str = "input") -> tuple[list[dict], list[str]]:
    """The chat messages (ChatMessage's shape) of `input` after `history`, and for each the field
    it came from (`input.<i>`), for errors. Raises OpenAIError naming the item (and its field) at
    fault."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [param]
    messages: list[dict] = []
    origins: list[str] = []
    # call_id -> function name: a result names its function (the calls may be in the history)
    names = {call["id"]: call["function"]["name"] for m in history for call in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            message = _validated(_InputMessage, item, where)
            messages.append({"role": message.role, "content": _text(message.content, _TEXT_PARTS[message.role],
                                                                    f"{where}.content")})
        elif kind == "function_call":
            call = _validated(_FunctionCall, item, where)
            names[call.call_id] = call.name
            entry = {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn: one message
                last.setdefault("tool_calls", []).append(entry)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
        elif kind == "function_call_output":
            result = _validated(_FunctionCallOutput, item, where)
            message = {"role": "tool", "tool_call_id": result.call_id,
                       "content": _text(result.output, ("input_text", "output_text"), f"{where}.output")}
            if result.call_id in names:
                message["name"] = names[result.call_id]
            messages.append(message)
        elif kind == "reasoning":
            continue  # NOTE: past thinking stays out of the prompt, as chat templates leave it out
        else:
            raise bad_request(f"input items of type {str(kind)[:64]!r} are not supported (message, function_call, "
                              "function_call_output and reasoning are).", param=f"{where}.type")
        origins.append(where)
    return messages, origins


def _validated(model: type[_Body], item: dict, where: str) -> Any:
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("list[", "str")))
        param = f"{where}.{loc}" if loc else where
        if first.get("type") == "missing":
            raise bad_request(f"Missing required parameter: '{param}'.", param=param) from None
        raise bad_request(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param) from None


def _text(content: str | list[_InputPart], kinds: tuple[str, ...], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in kinds or part.text is None:
            raise bad_request(f"content parts of type {part.type[:64]!r} are not supported here "
                              f"({', '.join(kinds)} are).", param=f"{param}.{j}.type")
        texts.append(part.text)
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Responses function tools (`{type, name, description, parameters, strict}`) in chat's
    shape; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools of type {str(kind)[:64]!r} are not supported; only function tools are.",
                              param=f"tools.{i}.type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """`{"type": "function", "name": ...}` in chat's shape; strings as they are (plan_tools checks them)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice of type {str(choice.get('type'))[:64]!r} is not supported "
                              '("none", "auto", "required" or {"type": "function", "name": ...} are).',
                              param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs schema, a JSON schema object.", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_}}


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict], list[str]]:
    """The chat request for `req` after the stored conversation `history` (ChatMessage dicts);
    with the conversation to store (history and this input, without the instructions) and each
    chat message's origin, for `renamed`."""
    messages, origins = input_messages(req.input, history)
    conversation = history + messages
    origins = ["previous_response_id"] * len(history) + origins
    chat = list(conversation)
    if req.instructions is not None:
        chat.insert(0, {"role": "system", "content": req.instructions})
        origins.insert(0, "instructions")
    body = {"model": req.model, "messages": chat, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req.text), "stream": bool(req.stream)}
    try:
        return ChatCompletionRequest.model_validate(body), conversation, origins
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = renamed_param(".".join(loc), origins)
        raise bad_request(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param) from None


_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format": "text.format"}


def renamed_param(param: str | None, origins: list[str]) -> str | None:
    """A chat field's name as this API names it."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        index = rest.partition(".")[0]
        return origins[int(index)] if index.isdigit() and int(index) < len(origins) else "input"
    if head == "tools":  # tools.<i>.function.<field> -> tools.<i>.<field>
        return re.sub(r"^tools\.(\d+)\.function\b\.?", lambda m: f"tools.{m.group(1)}.", param).rstrip(".")
    return _RENAMED.get(head, head) + (f".{rest}" if rest and head not in _RENAMED else "")


# A chat field's path in an error's text: a message's or a tool's fields, or a renamed field.
_FIELD_PATH = re.compile(r"(?<![\w.])(messages\.\d+(?:\.\w+)*|tools\.\d+\.function(?:\.\w+)*|"
                         r"max_completion_tokens|max_tokens|response_format)(?![\w.])")


def renamed(error: OpenAIError, origins: list[str]) -> OpenAIError:
    """`error` from the chat path, naming this API's field instead, in `param` and in its text
    (the same renaming: `messages.3.content` is `input.2`)."""
    param = renamed_param(error.param, origins)
    message = _FIELD_PATH.sub(lambda m: renamed_param(m.group(1), origins), error.message)
    if error.param is not None and param != error.param:
        # NOTE: the param itself only where the text names it (first, or quoted): a bare
        # "messages" is also a plain word ("at most 2048 messages")
        if message.startswith(error.param) and not re.match(r"[\w.]", message[len(error.param):len(error.param) + 1]):
            message = param + message[len(error.param):]
        message = message.replace(f"'{error.param}'", f"'{param}'")
    if (param, message) != (error.param, error.message):
        error = OpenAIError(error.status, message, type=error.type, param=param, code=error.code,
                            headers=error.headers)
    return error


def history_messages(stored: list[dict]) -> list[dict]:
    """A stored conversation, checked again as chat messages (a file written by another
    version, or edited, must not reach the template unchecked)."""
    return [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in stored]
