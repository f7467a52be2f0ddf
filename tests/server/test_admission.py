"""The routes through the one admission pipeline (server/admission.py): each refusal is a 400
with OpenAI's error body naming the field at fault, the same whichever route it came through."""

from __future__ import annotations

import pytest

from tests.server.support import assert_error, post

C, H = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

# (case, route, fields after model (and prompt / messages unless given), param, code, message start)
CASES = [
    ("empty-ids", C, {"prompt": []}, "prompt", None, "prompt must not be empty."),
    ("empty-text", C, {"prompt": ""}, "prompt", None, "prompt must not be empty."),
    ("one-empty-of-two", C, {"prompt": [[1, 2], []]}, "prompt", None, "prompt must not be empty."),
    ("id-out-of-vocab", C, {"prompt": [1, 10**6]}, "prompt", None, "prompt token ids must be in [0, "),
    ("too-many-prompts", C, {"prompt": ["a"] * 65}, "prompt", None, "At most 64 prompts per request"),
    ("context", C, {"max_tokens": 2048}, "prompt", "context_length_exceeded", "This model's maximum context length"),
    ("chat-context", H, {"max_tokens": 2047}, "messages", "context_length_exceeded",
     "This model's maximum context length"),
    ("chat-context-mct", H, {"max_completion_tokens": 2047}, "messages", "context_length_exceeded",
     "This model's maximum context length"),
    ("max-tokens-0", C, {"max_tokens": 0}, "max_tokens", None, "max_tokens must be at least 1"),
    ("max-completion-tokens-0", H, {"max_completion_tokens": 0}, "max_completion_tokens", None,
     "max_completion_tokens must be at least 1"),
    ("n-0", C, {"n": 0}, "n", None, "n must be at least 1"),
    ("n-over-max-n", H, {"n": 17}, "n", None, "n must be at most 16"),
    ("best-of-under-n", C, {"n": 3, "best_of": 2}, "best_of", None, "best_of must be greater than or equal to n"),
    ("seed", C, {"seed": 2**63}, "seed", None, "seed must be a 64-bit signed integer"),
    ("chat-seed", H, {"seed": -(2**63) - 1}, "seed", None, "seed must be a 64-bit signed integer"),
    ("beam-temperature", C, {"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature", None,
     "beam search requires temperature 0."),
    ("beam-width-1", C, {"use_beam_search": True}, "n", None, "beam search needs a beam width"),
    ("beam-guided", H, {"use_beam_search": True, "n": 2, "guided_regex": "a+"}, "use_beam_search", None,
     "beam search cannot be combined with structured outputs."),
    ("beam-tool", H, {"use_beam_search": True, "n": 2, "tool_choice": "required",
                      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "use_beam_search", None, "beam search cannot be combined with structured outputs."),
    ("top-p", H, {"top_p": 0}, "top_p", None, "top_p must be in (0, 1]"),
    ("logprobs-negative", C, {"logprobs": -1}, "logprobs", None, "logprobs must be non-negative"),
    ("width-over-max-num-seqs", C, {"n": 2, "best_of": 65}, "best_of", None, "best_of must be at most 16"),
]


@pytest.mark.parametrize("case,path,fields,param,code,message", CASES, ids=[c[0] for c in CASES])
def test_each_refusal_is_a_400_naming_its_param(real_server, model, case, path, fields, param, code, message):
    body = {"model": model, **({"messages": HI} if path == H else {"prompt": "Hi"}), **fields}
    error = assert_error(post(real_server, path, body), 400, param)
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    assert error["message"].startswith(message), error


def test_an_admitted_id_prompt_is_echoed_as_text(real_server, model):
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "echo": True, "temperature": 0}
    r = post(real_server, C, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3 and r.json()["choices"][0]["text"]
