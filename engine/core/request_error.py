"""`RequestError`: a request the engine or the server cannot take, through the user's own fault.

It is a `ValueError` (the offline `LLM` API and older callers catch that) that also names the
request field at fault in OpenAI's terms (`param`) and, where OpenAI has one, its error `code`,
so the server answers 400 with `{"message", "type", "param", "code"}` without guessing either
from the message. Raised by `SamplingParams` (one setting's range), `engine/core/admission.py` (the
prompt and the final max_tokens) and `engine/loop/request_checks.py` (what needs the pool's size).
"""

from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt + completion too long


class RequestError(ValueError):
    """`message` is fit to show the user; `param` names the request field at fault (None: no
    single field); `code`: OpenAI's error code, if it has one for this failure."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def renamed(self, param: str | None) -> "RequestError":
        """The same error naming `param` (an API whose field has another name: chat's
        max_completion_tokens is the engine's max_tokens); a message that starts with the old
        name says the new one."""
        message = self.message
        if self.param and param and message.startswith(self.param + " "):
            message = param + message[len(self.param):]
        return RequestError(message, param, self.code)
