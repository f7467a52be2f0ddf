"""Admission: a prompt's token ids and its sampling settings -> an `EngineRequest` the engine
can queue, or a `RequestError` naming the field at fault.

This is the one place the prompt's own limits are checked: not empty, every id in the
vocabulary, room in the context for the completion; and the one place the request's final
max_tokens is decided (`admit`). The server's input pipeline (server/admission.py) and the
engine's own `add_request` (the offline `LLM` API, tests) both call it; what needs the KV pool's
size is engine/loop/request_checks.py's, the server's own limits are server/sampling.py's, and each
sampling setting's range is `SamplingParams`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.request_error import CONTEXT_LENGTH_EXCEEDED, RequestError
from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdmissionLimits:
    """The model's limits on a prompt."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # prompt and completion together


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed admission: what `LLMEngine.add_admitted` queues as it is."""

    token_ids: list[int]  # the prompt: non-empty, every id in the vocabulary
    params: SamplingParams  # max_tokens final: >= 1, and prompt + max_tokens fit the context
    text: str | None = None  # the prompt's text, if known (reported back; echo)
    grammar: Any = None  # its structured-output state, started off the engine thread (None: none yet)


def check_not_empty(prompt: str | list[int], param: str = "prompt") -> None:
    """RequestError unless `prompt` (a text or token ids) has something in it."""
    if len(prompt) == 0:
        raise RequestError(f"{param} must not be empty.", param)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """RequestError unless every id is in [0, vocab_size) (one linear pass)."""
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"{param} token ids must be in [0, {vocab_size}).", param)


def context_length_error(prompt_len: int, n_out: int, max_model_len: int, param: str) -> RequestError:
    """OpenAI's wording for a prompt of `prompt_len` tokens that cannot have `n_out` more."""
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + n_out} tokens ({prompt_len} in the messages, {n_out} in the completion). "
        "Please reduce the length of the messages or completion.", param, CONTEXT_LENGTH_EXCEEDED)


def final_max_tokens(prompt_len: int, max_tokens: int | None, limits: AdmissionLimits, *,
                     defaulted: bool = False, param: str = "prompt") -> int:
    """How many tokens the request may generate after a prompt of `prompt_len` tokens.

    `max_tokens` None: up to the end of the context. An explicit `max_tokens` that does not fit
    is a RequestError (code context_length_exceeded); a `defaulted` one (the server chose it,
    not the user) is capped at the room left. NOTE: as vLLM does, a default is not the user's
    ask, so a long prompt gets the room left rather than a 400; only a prompt that leaves no room
    at all is refused."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise context_length_error(prompt_len, 1 if max_tokens is None or defaulted else max_tokens,
                                   limits.max_model_len, param)
    if max_tokens is None:
        return room
    if max_tokens > room:
        if not defaulted:
            raise context_length_error(prompt_len, max_tokens, limits.max_model_len, param)
        return room
    return max_tokens


def admit(token_ids: list[int], params: SamplingParams, limits: AdmissionLimits, *, defaulted: bool = False,
          param: str = "prompt", text: str | None = None, grammar: Any = None) -> EngineRequest:
    """The request of `token_ids` under `params`, with its final max_tokens (`final_max_tokens`).
    Raises RequestError naming `param` (the prompt's field: "prompt", or chat's "messages") for
    an empty prompt, an id out of the vocabulary, or no room for the completion. Linear in the
    prompt; mutates nothing (`params` is shared by a request's prompts, each gets its own copy
    when its max_tokens differs)."""
    token_ids = list(token_ids)
    check_not_empty(token_ids, param)
    check_token_ids(token_ids, limits.vocab_size, param)
    max_tokens = final_max_tokens(len(token_ids), params.max_tokens, limits, defaulted=defaulted, param=param)
    return EngineRequest(token_ids, params.with_max_tokens(max_tokens), text, grammar)
