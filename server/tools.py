"""Tool (function) calling on /v1/chat/completions, built on structured outputs.

A tool call is the JSON object `{"name": <tool name>, "arguments": {...}}` as the model's whole
answer. What `tool_choice` does with it:
- "none": no constraint; the answer is text (tools are still described, with "do not call").
- "auto" (the default when tools are given): no constraint; an answer that parses as a call to
  a known tool (`parse_tool_call`, a ```json fence allowed) becomes a tool call.
- "required": the answer is constrained by `call_schema` (anyOf over the tools) and always
  parses as a call; finish_reason "tool_calls".
- a named function: constrained to that tool only; finish_reason "stop" (as OpenAI answers).
One call per choice (`parallel_tool_calls` is accepted, not acted on).

The prompt (server/input_processor.py renders it): a chat template that renders `tools` itself
gets the tools and the history as they are; for one that does not (SmolLM2's), `text_messages`
puts a system-prompt block that describes the tools and the answer format first, and turns past
calls and their results into plain text turns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine.core.guided_decoding import GuidedDecoding
from engine.sample.structured_output import validate
from server.errors import bad_request
from server.protocol import (
    JsonTooDeep,
    JsonValueError,
    NamedToolChoice,
    check_json_value,
)
from server.settings import ServerSettings

MODES = ("none", "auto", "required", "named")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools` and `tool_choice` ask for, checked."""

    functions: list[dict]  # OpenAI function definitions: {"name", "description"?, "parameters"?}
    mode: str  # one of MODES
    named: str | None = None  # the function tool_choice names (mode "named")
    guided: GuidedDecoding | None = None  # the constraint for "required" / "named"
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def tools(self) -> list[dict]:
        """The tools in OpenAI's request shape (what HF chat templates take)."""
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def parses(self) -> bool:
        """Whether outputs are read back as tool calls."""
        return self.mode != "none" and bool(self.functions)

    @property
    def finish_reason(self) -> str:
        """The finish_reason of a choice that made a call."""
        return "stop" if self.mode == "named" else "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------- request checks
def plan_tools(req: Any, settings: ServerSettings | None = None) -> ToolPlan:
    """The request's tool plan; raises OpenAIError (400, naming the field) for bad or too many
    or too large tools (`settings`' limits; None: the defaults), a tool_choice that cannot be met,
    or tools next to another structured-output constraint (checked by the caller, which knows
    the other constraint). Linear in the size of the tools."""
    functions = _functions(req.tools or [], settings or ServerSettings())
    choice = req.tool_choice
    if choice is None:
        mode, named = ("auto" if functions else "none"), None
    elif isinstance(choice, str) and choice in ("none", "auto", "required"):
        mode, named = choice, None
    else:
        try:
            choice = NamedToolChoice.model_validate(choice)
        except ValidationError:
            message = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.'
            raise bad_request(message, param="tool_choice") from None
        mode, named = "named", choice.function.name
    if mode in ("required", "named") and not functions:
        raise bad_request(f"tool_choice {_show(choice)} needs tools.", param="tool_choice")
    names = frozenset(f["name"] for f in functions)
    if named is not None and named not in names:
        raise bad_request(f"tool_choice names the function {named[:64]!r}, which is not among the tools.",
                          param="tool_choice")
    guided = None
    if mode in ("required", "named"):
        chosen = [f for f in functions if mode == "required" or f["name"] == named]
        guided = GuidedDecoding.json_schema(call_schema(chosen))
    return ToolPlan(functions, mode, named, guided, names)


def check_tool_schemas(plan: ToolPlan) -> None:
    """Compile the schema of each tool the plan constrains to, so that a bad one is a 400 named
    by its tool (`tools.<i>.function.parameters`). Costs a grammar compile per tool: the input
    processor calls it on its worker thread, never on the event loop."""
    if plan.guided is None:
        return
    for i, f in enumerate(plan.functions):
        if plan.mode == "required" or f["name"] == plan.named:
            _check(GuidedDecoding.json_schema(call_schema([f])), f"tools.{i}.function.parameters")


def _functions(tools: list, settings: ServerSettings) -> list[dict]:
    """The tools' function definitions, checked one by one, then their total size."""
    if len(tools) > settings.max_tools:
        raise bad_request(f"tools may hold at most {settings.max_tools} tools, got {len(tools)} (--max-tools).",
                          param="tools")
    functions: list[dict] = []
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(tools):
        fn = tool.function
        param = f"tools.{i}.function"
        if not fn.name:
            raise bad_request("a function name must be a non-empty string.", param=f"{param}.name")
        if fn.name in seen:
            raise bad_request(f"tool names must be unique; {fn.name[:64]!r} is given twice.", param=f"{param}.name")
        seen.add(fn.name)
        if fn.parameters is not None:
            _check_parameters(fn.name, fn.parameters, f"{param}.parameters", settings)
        function = {k: v for k, v in (("name", fn.name), ("description", fn.description),
                                      ("parameters", fn.parameters)) if v is not None}
        size = len(json.dumps(function, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > settings.max_tool_schema_bytes:
            raise bad_request(f"the tool {fn.name[:64]!r} is too large: {size} bytes of JSON exceeds the limit of "
                              f"{settings.max_tool_schema_bytes} (--max-tool-schema-bytes).", param=param)
        total += size
        functions.append(function)
    if total > settings.max_total_tool_schema_bytes:
        raise bad_request(f"the tools are too large: {total} bytes of JSON exceeds the limit of "
                          f"{settings.max_total_tool_schema_bytes} (--max-total-tool-schema-bytes).", param="tools")
    return functions


def _check_parameters(name: str, parameters: dict, param: str, settings: ServerSettings) -> None:
    """A parameters schema: a JSON schema of type object, nested at most --max-json-depth levels
    (what `_has_ref` and `_rebase_refs` recurse through)."""
    if parameters.get("type", "object") != "object":
        raise bad_request(f"the parameters of {name[:64]!r} must be a JSON schema of type object.", param=param)
    try:
        check_json_value(parameters, settings.max_json_depth)
    except JsonTooDeep as exc:
        raise bad_request(f"the parameters of {name[:64]!r}: {exc} (--max-json-depth).", param=param) from None
    except JsonValueError as exc:
        raise bad_request(f"the parameters of {name[:64]!r}: {exc}.", param=param) from None


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def _check(guided: GuidedDecoding, param: str) -> None:
    try:
        validate(guided)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


# --------------------------------------------------------------------------- the schema
def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call to any of `functions`: {"name": const, "arguments": its
    parameters schema}, both required, nothing else; anyOf when there are several.

    A parameters schema with `$ref`s moves under `$defs/tool<i>` of the root, its local refs
    rewritten to point there (they are relative to the document's root)."""
    defs: dict[str, Any] = {}
    options = []
    for i, f in enumerate(functions):
        params = f.get("parameters") or {"type": "object"}
        if _has_ref(params):
            key = f"tool{i}"
            defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        options.append({"type": "object",
                        "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


# ----------------------------------------------------------------------------- the prompt
def tool_prompt_block(plan: ToolPlan) -> str:
    """The system-prompt text that describes the tools and the answer format, for templates
    that do not render tools themselves."""
    lines = ["You can call these tools (functions):"]
    for f in plan.functions:
        desc = f" - {f['description']}" if f.get("description") else ""
        params = json.dumps(f.get("parameters") or {"type": "object"}, ensure_ascii=False)
        lines.append(f"- {f['name']}{desc}\n  arguments (JSON schema): {params}")
    call = 'To call a tool, answer with only this JSON object: {"name": <tool name>, "arguments": {...}}'
    if plan.mode == "none":
        lines.append("Do not call a tool now: answer in plain text.")
    elif plan.mode == "auto":
        lines.append(f"{call}\nIf no tool is needed, answer in plain text.")
    elif plan.mode == "required":
        lines.append(f"{call}\nYou must call one of the tools.")
    else:
        lines.append(f"{call}\nCall the tool {plan.named}.")
    return "\n".join(lines)


def text_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """`messages` (template dicts) for a template that does not know tools: the tool block in
    the system message (a new first one if there is none), each past call as the JSON the
    model is asked for, each tool result as a user turn that says what it answers."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            what = m.get("name") or m.get("tool_call_id")
            out.append({"role": "user", "content": f"Tool result ({what}):\n{m.get('content') or ''}"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if plan is not None and plan.functions:
        block = tool_prompt_block(plan)
        if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    return json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}, ensure_ascii=False)


# ------------------------------------------------------------------------------ outputs
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?\s*```$", re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


def parse_tool_call(text: str, names: frozenset[str] | set[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) if the whole `text` (stripped, optionally inside a
    ```json fence) is {"name": a known tool, "arguments": an object}; else None.

    The arguments string is the model's own text of the object where it can be cut out (so a
    streamed call's fragments join into the same string), else the object re-serialised."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and isinstance(obj["name"], str)
            and obj["name"] in names and isinstance(obj["arguments"], dict)):
        return None
    head = _HEAD.match(body)
    if head:
        try:
            args, end = json.JSONDecoder().raw_decode(body, head.end())
            if args == obj["arguments"] and body[end:].strip() == "}":
                return obj["name"], body[head.end():end]
        except ValueError:
            pass
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


def _call_head(text: str, names: frozenset[str] | set[str]) -> tuple[str, int] | None:
    """(name, where the arguments start) once `text` has passed
    `{"name": <a known tool>, "arguments": `; else None."""
    head = _HEAD.match(text)
    if head is None:
        return None
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None
    return (name, head.end()) if name in names else None


def partial_call(text: str, names: frozenset[str] | set[str]) -> tuple[str, str] | None:
    """For a constrained answer cut short (max_tokens, a stop string): (name, the arguments'
    text so far) once the text has passed `{"name": <a known tool>, "arguments": `; else None.
    What a streamed call would have sent by then, so both answers agree."""
    head = _call_head(text, names)
    return None if head is None else (head[0], text[head[1]:])


class CallStreamer:
    """One choice's streamed tool call, from the growing output text of a constrained
    ("required" / named) generation: the call's id and name once the text has passed
    `{"name": "...", "arguments": `, then the arguments' text as it grows (holding back
    trailing `}` and spaces, which may close the outer object), the rest at the end.

    `feed` returns (name to announce or None, argument fragment); `finish` returns the last
    fragment and whether the text was a call at all."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""
        self.name: str | None = None
        self.args_start = 0
        self.sent = ""  # argument text sent so far

    def feed(self, delta: str) -> tuple[str | None, str]:
        self.text += delta
        announced = None
        if self.name is None:
            head = _call_head(self.text, self.names)
            if head is None:
                return None, ""
            self.name, self.args_start = head
            announced = self.name
        ready = self.text[self.args_start:].rstrip("} \n\t\r")
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return announced, ""
        fragment, self.sent = ready[len(self.sent):], ready
        return announced, fragment

    def finish(self) -> tuple[tuple[str, str] | None, str]:
        """(the parsed call or None, the argument text not sent yet)."""
        call = parse_tool_call(self.text, self.names)
        if call is None:
            rest = self.text[self.args_start + len(self.sent):] if self.name is not None else ""
            return None, rest
        if self.name is not None and call[0] == self.name and call[1].startswith(self.sent):
            return call, call[1][len(self.sent):]
        return call, call[1]


def may_be_call(text: str) -> bool:
    """Whether an "auto" choice's text so far could still turn out to be a whole tool call
    (streaming holds such text back until it knows)."""
    head = text.lstrip()
    return head.startswith(("{", "```")) or "```".startswith(head)
