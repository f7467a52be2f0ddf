"""Structured outputs in the engine on the default model: outputs match their JSON schema,
regex or choice list; greedy constrained decoding equals HF's greedy decoding under the same
masks token for token; constraints stay per sequence (n > 1, mixed batches); bad constraints
are ValueErrors. Every test leaves the pool free (the make_llm fixture checks)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.core.guided_decoding import GuidedDecoding
from engine.core.sampling_params import SamplingParams
from engine.sample.structured_output import StructuredOutputCompiler, apply_grammar_masks

BASE = {"block_size": 16}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def chat(llm, text: str) -> list[int]:
    prompt = llm.engine.chat_prompt([{"role": "user", "content": text}])
    return llm.tokenizer(prompt, add_special_tokens=False).input_ids


def test_json_schema_output_parses_and_matches(make_llm):
    llm = make_llm(**BASE)
    params = SamplingParams(temperature=0, max_tokens=64, guided_decoding=GuidedDecoding.json_schema(PERSON))
    out = llm.generate([chat(llm, "Describe a person as JSON.")], params)[0].outputs[0]
    assert out.finish_reason == "stop", out
    person = json.loads(out.text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["city"] in ("Paris", "London", "Tokyo") and len(person["name"]) <= 12


def test_greedy_regex_equals_hf_greedy_under_the_same_masks(make_llm, hf_model, tokenizer):
    llm = make_llm(**BASE)
    ids = chat(llm, "What is the phone number of the museum?")
    spec = GuidedDecoding("regex", PHONE)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, guided_decoding=spec))[0].outputs[0]
    assert re.fullmatch(PHONE, out.text) and out.finish_reason == "stop"
    # The reference: HF's logits, masked by a fresh matcher, argmax, until the grammar ends.
    vocab = hf_model.config.vocab_size
    state = StructuredOutputCompiler(tokenizer, vocab).start(spec)
    ref: list[int] = []
    with torch.no_grad():
        while not state.is_complete:
            logits = hf_model(torch.tensor([ids + ref])).logits[:, -1, :].float()
            apply_grammar_masks(logits, [(0, state)])
            token = int(logits.argmax())
            assert state.accept(token)
            ref.append(token)
    assert out.token_ids == ref


def test_choice_and_n_samples_each_keep_their_own_grammar(make_llm):
    llm = make_llm(**BASE)
    choices = ["red", "green", "blue", "purple"]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, guided_decoding=GuidedDecoding.choice(choices))
    outs = llm.generate([chat(llm, "Name a colour.")], params)[0].outputs
    assert len(outs) == 4
    for o in outs:
        assert o.text in choices and o.finish_reason == "stop", o


def test_constraints_do_not_leak_into_other_requests_of_the_batch(make_llm):
    llm = make_llm(**BASE)
    free_prompt = chat(llm, "Say hello.")
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate([free_prompt], free)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=0, max_tokens=24, guided_decoding=GuidedDecoding("regex", r"[0-9]{4}"))
    outs = llm.generate([chat(llm, "Pick a year."), free_prompt, chat(llm, "Pick a PIN.")], [guided, free, guided])
    assert outs[1].outputs[0].token_ids == alone
    for o in (outs[0], outs[2]):
        assert re.fullmatch(r"[0-9]{4}", o.outputs[0].text)


@pytest.mark.parametrize("spec", [GuidedDecoding("regex", "(unclosed"), GuidedDecoding("json", '{"type": 3}')],
                         ids=["regex", "json"])
def test_bad_constraint_is_a_value_error(make_llm, spec):
    llm = make_llm(**BASE)
    with pytest.raises(ValueError, match="invalid"):
        llm.engine.add_request("bad-constraint", llm.tokenizer("Hi").input_ids, SamplingParams(guided_decoding=spec))
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_with_a_constraint_is_refused():
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0, guided_decoding=GuidedDecoding.json_schema())


def test_unsatisfiable_constraint_fails_alone_as_an_invalid_request(make_llm):
    # U+A8684 needs the byte 0xF2, which no token of this vocabulary holds: the grammar
    # rejects the token its own mask allowed. That request fails as the request's fault; its
    # neighbour in the batch finishes normally.
    llm = make_llm(**BASE)
    bad = SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecoding("regex", "\u00e0\U000a8684"))
    good = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate(["Hello", "Hello"], [bad, good])
    assert outs[0].invalid_request and "cannot be met" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
