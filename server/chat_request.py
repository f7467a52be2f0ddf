"""A chat request's way to the engine, shared by every route that speaks in messages
(/v1/chat/completions, /v1/responses through server/responses_api.py, /tokenize): its messages
as the chat template takes them (`to_template_messages`), then `prepare_chat`: the tool plan
(server/tools.py), the admission (server/admission.py) and the format its outputs are read in
(server/chat_output.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.admission import Admitted, PromptSource, admit
from server.chat_output import OutputFormat
from server.context import ServerContext
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, ChatMessage
from server.tools import plan_tools


@dataclass(frozen=True)
class PreparedChat:
    admitted: Admitted  # the sampling settings and the engine request, ready to start
    fmt: OutputFormat  # how the outputs are read: reasoning, tool calls, plain text


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest, continue_final: bool = False) -> PreparedChat:
    """`req`'s engine requests, admitted, and its output format; raises OpenAIError (a 400
    naming the chat field at fault: `messages.<i>...`, `tools...`, `max_completion_tokens`).
    `continue_final`: the answer continues the final (assistant) message: Anthropic's prefill."""
    plan = plan_tools(req, ctx.settings)
    messages = to_template_messages(req.messages)
    admitted = await admit(ctx, req, PromptSource(messages=messages, plan=plan,
                                                  template_kwargs=req.chat_template_kwargs,
                                                  continue_final=continue_final))
    think = ctx.settings.think_format
    fmt = OutputFormat(plan, think, think is not None and think.opened_by(admitted.requests[0].text or ""),
                       ctx.settings.tool_call_parser)
    return PreparedChat(admitted, fmt)


def to_template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain `{role, content}` dicts for the chat template; text parts are joined by newlines,
    a "developer" message becomes a "system" one.
    An assistant message keeps its `tool_calls` (arguments as an object where they parse as
    one, as HF templates expect), a tool message its `tool_call_id` (required) and `name`."""
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Only text content parts are supported, got type {part.type!r}.",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        # NOTE: OpenAI's "developer" role (newer SDKs send it) is the system prompt by another
        # name; chat templates know only "system".
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.role == "tool":
            if not message.tool_call_id:
                raise bad_request("a tool message needs the tool_call_id of the call it answers.",
                                  param=f"messages.{i}.tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request("only assistant messages carry tool_calls.", param=f"messages.{i}.tool_calls")
            entry["tool_calls"] = [{"id": call.id or f"call_{i}_{j}", "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments(call.function.arguments)}}
                                   for j, call in enumerate(message.tool_calls)]
        result.append(entry)
    return result


def _arguments(arguments: str | dict) -> str | dict:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments
