"""Structured-output building blocks on the default model's tokenizer: constraints compile or
fail with a message fit for a 400, masks allow exactly what the grammar allows, forks are
independent, and a masked random walk always ends in a matching output."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.structured_output import GuidedDecoding, StructuredOutputCompiler, apply_grammar_masks
from engine.tokenizer import load_tokenizer

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, VOCAB)


BAD = [
    (GuidedDecoding("regex", "a["), "unclosed character class"),
    (GuidedDecoding("json", '{"type": "foo"}'), "Invalid type"),
    (GuidedDecoding("json", "[1]"), "must be a JSON object"),
    (GuidedDecoding("json", "{not json"), "not valid JSON"),
    (GuidedDecoding("choice", "[]"), "non-empty list"),
    (GuidedDecoding("choice", '["a", 3]'), "non-empty strings"),
    (GuidedDecoding("grammar", "start: x\nfoo"), "Expected"),
]


@pytest.mark.parametrize("spec,message", BAD, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(BAD)])
def test_bad_constraints_raise_value_error_with_reason(compiler, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.start(spec)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind must be one of"):
        GuidedDecoding("xml", "<a/>")


def test_mask_allows_exactly_the_digits(compiler, tokenizer):
    state = compiler.start(GuidedDecoding("regex", "[0-9]{3}"))
    logits = torch.zeros(3, VOCAB)
    apply_grammar_masks(logits, [(1, state)])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    # Every token made of 1-3 digits and nothing else, and no other token.
    expected = [t for t in range(len(tokenizer)) if re.fullmatch(r"[0-9]{1,3}", tokenizer.decode([t]))]
    assert allowed == expected
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()  # unlisted rows untouched


def test_fork_is_independent(compiler, tokenizer):
    parent = compiler.start(GuidedDecoding.choice(["yes", "no"]))
    child = parent.fork()
    assert parent.accept(tokenizer.encode("yes")[0])
    logits = torch.zeros(2, VOCAB)
    apply_grammar_masks(logits, [(0, parent), (1, child)])
    child_allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[1]).nonzero().flatten().tolist()}
    assert "no" in child_allowed and "yes" in child_allowed


def test_rejected_token_reports_error(compiler, tokenizer):
    state = compiler.start(GuidedDecoding("regex", "[0-9]+"))
    assert not state.accept(tokenizer.encode("hello")[0])
    assert state.error


SPECS = [
    GuidedDecoding("regex", r"[a-z]{2,5}@[a-z]{3}\.com"),
    GuidedDecoding.choice(["Paris", "London", "New York"]),
    GuidedDecoding.json_schema({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_random_walk_under_mask_matches(compiler, tokenizer, spec):
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        state, out = compiler.start(spec), []
        while not state.is_complete and len(out) < 200:
            logits = torch.randn(1, VOCAB, generator=gen)
            apply_grammar_masks(logits, [(0, state)])
            token = int(torch.distributions.Categorical(logits=logits[0]).sample())
            if token == tokenizer.eos_token_id:
                break
            assert state.accept(token), state.error
            out.append(token)
        text = tokenizer.decode(out)
        if spec.kind == "regex":
            assert re.fullmatch(spec.value, text), text
        elif spec.kind == "choice":
            assert text in json.loads(spec.value)
        else:
            obj = json.loads(text)
            assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and len(obj["name"]) <= 8
