"""`ResponseEvents`: the server-sent events of one streamed /v1/responses answer, made from the
chat path's delta fields (server/chat_output.py's `ChoiceStream`: `reasoning_content`,
`content`, `tool_calls`).

The sequence, as OpenAI sends it (each frame `event: <type>` + `data: {...}`, every event with
its `sequence_number`, counting from 0; no `[DONE]`):
- `response.created`, `response.in_progress` (the response so far: no output);
- per output item, in order: `response.output_item.added`, then
  - reasoning: `response.reasoning_summary_part.added`, `.reasoning_summary_text.delta`...,
    `.reasoning_summary_text.done`, `.reasoning_summary_part.done`;
  - a message: `response.content_part.added`, `response.output_text.delta`...,
    `response.output_text.done`, `response.content_part.done`;
  - a function call: `response.function_call_arguments.delta`..., `.function_call_arguments.done`;
  then `response.output_item.done` with the whole item;
- last `response.completed` (or `response.incomplete` with `incomplete_details.reason`
  "max_output_tokens"), holding the whole response and its usage; a failure after the headers
  went out ends the stream with `response.failed` and the error instead.
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import OpenAIError
from server.responses_api import ResponsesRequest, new_id
from server.responses_output import (
    call_item,
    message_item,
    output_text,
    reasoning_item,
    response_object,
    status_of,
)


class ResponseEvents:
    def __init__(self, rid: str, req: ResponsesRequest, model: str, created: float) -> None:
        self.rid, self.req, self.model, self.created = rid, req, model, created
        self.seq = 0
        self.output: list[dict] = []  # items done
        self.item: dict | None = None  # the item being streamed
        self.text = ""  # its text so far (summary, output text or arguments)
        self.calls = 0  # function calls streamed
        self.dropped = False  # the call being read is past max_tool_calls: its arguments are not sent

    def frame(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def response(self, status: str, **more: Any) -> dict:
        return response_object(self.rid, self.req, self.model, self.created, status, list(self.output), **more)

    def start(self) -> list[str]:
        return [self.frame("response.created", response=self.response("in_progress")),
                self.frame("response.in_progress", response=self.response("in_progress"))]

    def step(self, fields: dict) -> list[str]:
        """The events for one delta's fields."""
        frames: list[str] = []
        if fields.get("reasoning_content"):
            frames += self._open("reasoning")
            frames.append(self._delta("response.reasoning_summary_text.delta", fields["reasoning_content"],
                                      summary_index=0))
        if fields.get("content"):
            frames += self._open("message")
            frames.append(self._delta("response.output_text.delta", fields["content"], content_index=0, logprobs=[]))
        limit = self.req.max_tool_calls
        for call in fields.get("tool_calls") or []:
            if call.id is not None:  # a new call
                self.dropped = limit is not None and self.calls >= limit
                if self.dropped:  # NOTE: the first max_tool_calls calls are kept, as output_items keeps them
                    continue
                self.calls += 1
                frames += self._close("completed")
                self.item = call_item(new_id("fc"), call.id, call.function.name or "", "", "in_progress")
                frames.append(self._added())
            if (call.function.arguments and not self.dropped and self.item is not None
                    and self.item["type"] == "function_call"):
                frames.append(self._delta("response.function_call_arguments.delta", call.function.arguments))
        return frames

    def finish(self, finish_reason: str | None, usage: dict) -> tuple[list[str], dict]:
        """The closing events, and the final response (what is stored)."""
        status, incomplete = status_of(finish_reason)
        frames = self._close("incomplete" if incomplete else "completed")
        if not self.output:  # an empty answer is still one (empty) message, as the whole answer has it
            frames += self._open("message") + self._close("completed")
        final = self.response(status, usage_info=usage, incomplete=incomplete)
        frames.append(self.frame(f"response.{status}", response=final))
        return frames, final

    def failed(self, error: OpenAIError) -> str:
        """The stream's last event when it fails after the headers went out."""
        body = {"code": error.code or "server_error", "message": error.message}
        return self.frame("response.failed", response=self.response("failed", error=body))

    # ------------------------------------------------------------------------------ items
    def _open(self, kind: str) -> list[str]:
        """Start an item of `kind` unless one is being streamed."""
        if self.item is not None and self.item["type"] == kind:
            return []
        frames = self._close("completed")
        if kind == "reasoning":
            self.item = reasoning_item(new_id("rs"), None, "in_progress")
            part = {"type": "summary_text", "text": ""}
            return frames + [self._added(), self._frame_item("response.reasoning_summary_part.added",
                                                             summary_index=0, part=part)]
        self.item = message_item(new_id("msg"), None, "in_progress")
        return frames + [self._added(), self._frame_item("response.content_part.added", content_index=0,
                                                         part=output_text(""))]

    def _close(self, status: str) -> list[str]:
        item, text = self.item, self.text
        if item is None:
            return []
        self.item, self.text = None, ""
        frames = []
        item["status"] = status
        index = len(self.output)
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            frames += [self.frame("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                                  summary_index=0, text=text),
                       self.frame("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                                  summary_index=0, part=part)]
        elif item["type"] == "message":
            item["content"] = [output_text(text)]
            frames += [self.frame("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                       self.frame("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=output_text(text))]
        else:
            item["arguments"] = text
            frames.append(self.frame("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=text))
        self.output.append(item)
        frames.append(self.frame("response.output_item.done", output_index=index, item=item))
        return frames

    def _added(self) -> str:
        return self.frame("response.output_item.added", output_index=len(self.output), item=dict(self.item))

    def _frame_item(self, kind: str, **fields: Any) -> str:
        return self.frame(kind, item_id=self.item["id"], output_index=len(self.output), **fields)

    def _delta(self, kind: str, delta: str, **fields: Any) -> str:
        self.text += delta
        return self._frame_item(kind, delta=delta, **fields)
