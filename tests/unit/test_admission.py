"""The admission pipeline's engine half (engine/core/admission.py, engine/loop/request_checks.py,
SamplingParams): each limit raises a `RequestError` naming OpenAI's `param` (and `code`), the
final max_tokens is decided once, and each message is defined in one place."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import pytest

from engine.core.admission import AdmissionLimits, EngineRequest, admit, final_max_tokens
from engine.core.guided_decoding import GuidedDecoding
from engine.core.request_error import CONTEXT_LENGTH_EXCEEDED, RequestError
from engine.core.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager
from engine.loop.request_checks import check_fits
from server.errors import from_request_error

LIMITS = AdmissionLimits(vocab_size=100, max_model_len=32)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def refused(fn, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args, **kwargs)
    return e.value


# (case, prompt, params, admit kwargs, param, code, message start)
PROMPT_CASES = [
    ("empty", [], SamplingParams(), {}, "prompt", None, "prompt must not be empty."),
    ("empty-chat", [], SamplingParams(), {"param": "messages"}, "messages", None, "messages must not be empty."),
    ("id-too-big", [1, 100], SamplingParams(), {}, "prompt", None, "prompt token ids must be in [0, 100)."),
    ("id-negative", [-1], SamplingParams(), {}, "prompt", None, "prompt token ids must be in [0, 100)."),
    ("explicit-too-long", [1] * 30, SamplingParams(max_tokens=3), {}, "prompt", CONTEXT_LENGTH_EXCEEDED,
     "This model's maximum context length is 32 tokens. However, you requested 33 tokens (30 in the messages, "
     "3 in the completion)"),
    ("no-room", [1] * 32, SamplingParams(max_tokens=None), {}, "prompt", CONTEXT_LENGTH_EXCEEDED,
     "This model's maximum context length is 32 tokens. However, you requested 33 tokens (32 in the messages, "
     "1 in the completion)"),
    ("no-room-defaulted", [1] * 32, SamplingParams(max_tokens=16), {"defaulted": True, "param": "messages"},
     "messages", CONTEXT_LENGTH_EXCEEDED, "This model's maximum context length is 32 tokens. However, you requested "
     "33 tokens"),
]


@pytest.mark.parametrize("case,ids,params,kwargs,param,code,message", PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_each_prompt_limit_raises_its_typed_error(case, ids, params, kwargs, param, code, message):
    e = refused(admit, ids, params, LIMITS, **kwargs)
    assert isinstance(e, ValueError)  # the offline API and older callers catch ValueError
    assert (e.param, e.code) == (param, code)
    assert str(e).startswith(message), str(e)


def test_the_final_max_tokens_is_decided_once():
    params = SamplingParams(max_tokens=16)
    assert admit([1] * 10, params, LIMITS).params is params  # fits: the same settings object
    capped = admit([1] * 20, params, LIMITS, defaulted=True)  # a default is capped at the room left
    assert capped.params.max_tokens == 12 and params.max_tokens == 16  # the shared settings untouched
    assert admit([1] * 20, SamplingParams(max_tokens=None), LIMITS).params.max_tokens == 12  # None: to the end
    assert final_max_tokens(31, 5, LIMITS, defaulted=True) == 1
    request = admit((1, 2), params, LIMITS, text="hi")
    assert request == EngineRequest([1, 2], params, "hi", None)


# SamplingParams: (kwargs, param) -- each setting's own range, checked there alone.
SETTING_CASES = [
    (dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"), (dict(best_of=0), "best_of"),
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(use_beam_search=True, n=1, temperature=0), "n"),
    (dict(use_beam_search=True, n=2, temperature=0.5), "temperature"),
    (dict(use_beam_search=True, n=2, temperature=0, early_stopping="x"), "early_stopping"),
    (dict(use_beam_search=True, n=2, temperature=0, guided_decoding=GuidedDecoding.json_schema()), "use_beam_search"),
    (dict(temperature=float("nan")), "temperature"), (dict(n=1.0), "n"),
]


@pytest.mark.parametrize("kwargs,param", SETTING_CASES, ids=[repr(k)[:40] for k, _ in SETTING_CASES])
def test_each_setting_names_its_param(kwargs, param):
    assert refused(SamplingParams, **kwargs).param == param


def test_what_needs_the_pool_is_the_engines_own():
    bm = BlockManager(4, 4, 4)  # 4 blocks of 4 tokens
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=3))

    def fits(ids, **kwargs):
        check_fits(admit(ids, SamplingParams(**kwargs), AdmissionLimits(100, 64)), config, bm)

    fits([1] * 16, max_tokens=1)
    e = refused(fits, [1] * 17, max_tokens=1)
    assert (e.param, str(e)) == ("prompt", "The prompt needs 5 KV blocks but the whole KV cache has 4; "
                                           "it can never be scheduled.")
    assert refused(fits, [1], n=4).param == "n"
    assert refused(fits, [1], n=2, best_of=4).param == "best_of"
    e = refused(fits, [1] * 4, n=2, use_beam_search=True, temperature=0, max_tokens=8)
    assert e.param == "n" and "too wide for beam search over 12 tokens" in str(e)


def test_the_server_takes_the_errors_own_param_and_code():
    e = RequestError("prompt must not be empty.", "prompt")
    assert from_request_error(e, "messages").param == "messages"  # chat's prompt is its messages
    body = from_request_error(RequestError("x", "prompt", CONTEXT_LENGTH_EXCEEDED)).body()["error"]
    assert body == {"message": "x", "type": "invalid_request_error", "param": "prompt",
                    "code": CONTEXT_LENGTH_EXCEEDED}
    assert from_request_error(RequestError("top_p must be in (0, 1], got 0.", "top_p")).param == "top_p"
    # NOTE: a plain ValueError (a bug's, a library's) names no field: nothing is guessed from its words.
    assert from_request_error(ValueError("n is wrong")).param is None
    assert RequestError("m", "max_tokens").renamed("max_completion_tokens").param == "max_completion_tokens"


# Each refusal's wording, defined once in engine/ and server/ (the duplicates issue 46 removed).
MESSAGES = ["must not be empty", "maximum context length is", "greater than or equal to n", "64-bit signed",
            "cannot be combined with structured outputs", "requires temperature 0", "token ids must be in",
            "KV blocks but the whole KV cache", "is too wide for beam search", "must be at most {max_seqs}"]


@pytest.mark.parametrize("message", MESSAGES)
def test_each_message_is_defined_in_one_place(message):
    where = [f"{path.relative_to(ROOT)}:{i}"
             for folder in ("engine", "server") for path in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if message in line and not re.match(r"\s*#", line)]
    assert len(where) == 1, where


def test_a_renamed_error_names_the_new_field_in_its_message_too():
    from engine.core.request_error import RequestError

    err = RequestError("max_tokens must be at least 1, got 0.", "max_tokens").renamed("max_completion_tokens")
    assert (err.param, err.message) == ("max_completion_tokens", "max_completion_tokens must be at least 1, got 0.")
    other = RequestError("The prompt is too long.", "prompt").renamed("messages")
    assert (other.param, other.message) == ("messages", "The prompt is too long.")
