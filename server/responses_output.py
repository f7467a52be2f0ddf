"""The Responses API's output side: a chat answer (server/chat_output.py's `ResponseMessage`)
as Responses output items (`output_items`), the Responses object (`response_object`) and its
usage, and the output as chat messages for the stored conversation (`output_messages`). The
request side is server/responses_api.py; the streamed events server/responses_events.py."""

from __future__ import annotations

import time
from typing import Any

from server.protocol import ResponseMessage, UsageInfo
from server.responses_api import ResponsesRequest, TextFormat, new_id


def output_items(message: ResponseMessage, status: str = "completed", max_calls: int | None = None) -> list[dict]:
    """A chat answer's message as Responses output items: its reasoning, its text, its calls
    (the first `max_calls` of them: `max_tool_calls`, as `ResponseEvents` streams them)."""
    items = []
    if message.reasoning_content is not None:
        items.append(reasoning_item(new_id("rs"), message.reasoning_content, status))
    if message.content or not (message.tool_calls or items):
        items.append(message_item(new_id("msg"), message.content or "", status))
    for call in (message.tool_calls or [])[:max_calls]:
        items.append(call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, status))
    return items


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    summary = [] if text is None else [{"type": "summary_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": summary, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_messages(output: list[dict]) -> list[dict]:
    """The output items as chat messages (ChatMessage's shape), for the stored conversation:
    the text and the calls as one assistant message; reasoning left out."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


def usage(info: UsageInfo, reasoning_tokens: int = 0) -> dict:
    """The Responses usage of the chat path's; `reasoning_tokens`: of the output tokens, the
    reasoning's (server/reasoning.py's `reasoning_token_count`)."""
    cached = info.prompt_tokens_details.cached_tokens if info.prompt_tokens_details else 0
    return {"input_tokens": info.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": info.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": info.total_tokens}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(the response's status, its incomplete_details) for the choice's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(rid: str, req: ResponsesRequest, model: str, created: float, status: str,
                    output: list[dict], usage_info: dict | None = None, incomplete: dict | None = None,
                    error: dict | None = None) -> dict:
    """The Responses object, field for field (OpenAI's `Response`)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
        "background": False, "error": error, "incomplete_details": incomplete,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": req.reasoning.summary if req.reasoning else None},
        "store": bool(req.store), "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "truncation": "disabled", "usage": usage_info,
        "user": req.user, "metadata": req.metadata or {},
    }
