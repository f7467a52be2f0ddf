"""Structured-output building blocks on the default model's tokenizer: constraints compile or
fail with a message fit for a 400, masks allow exactly what the grammar allows, forks are
independent, and a masked random walk always ends in a matching output."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.core.guided_decoding import GuidedDecoding
from engine.loop.tokenizer import load_tokenizer
from engine.sample.structured_output import (
    GrammarCache,
    StructuredOutputCompiler,
    apply_grammar_masks,
    entry_bytes,
)

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


# --- the compiled-grammar cache ------------------------------------------------------------------


def regex(i: int, width: int = 1) -> GuidedDecoding:
    return GuidedDecoding("regex", f"a{i}" + "b" * width)


def test_grammar_cache_evicts_least_recently_used_by_entries():
    cache = GrammarCache(max_entries=3, max_bytes=1 << 20)
    for i in range(3):
        cache.put(regex(i), f"g{i}")
    assert cache.get(regex(0)) == "g0"  # 0 is now the most recently used
    cache.put(regex(3), "g3")
    assert regex(1) not in cache and [s in cache for s in (regex(0), regex(2), regex(3))] == [True] * 3
    assert len(cache) == 3


def test_grammar_cache_is_bounded_by_bytes():
    one = entry_bytes(regex(0, 1000), "x" * 5000)
    cache = GrammarCache(max_entries=100, max_bytes=3 * one)
    for i in range(10):
        cache.put(regex(i, 1000), "x" * 5000)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 3 and all(regex(i, 1000) in cache for i in (7, 8, 9))
    cache.put(regex(99, 1000), "x" * (4 * one))  # larger than the whole bound: not stored
    assert regex(99, 1000) not in cache and len(cache) == 3
    cache.put(regex(9, 1000), "y")  # replacing an entry counts its new size only
    assert cache.bytes == 2 * one + entry_bytes(regex(9, 1000), "y")


def test_compiler_uses_but_does_not_cache_an_oversized_grammar(tokenizer):
    compiler = StructuredOutputCompiler(tokenizer, VOCAB)
    small = GuidedDecoding("regex", "[0-9]{3}")
    big = GuidedDecoding("regex", "[0-9]{3}-" + "[a-z]" * 300)
    compiler._grammars = GrammarCache(max_entries=8, max_bytes=entry_bytes(small, compiler.grammar(small)) + 64)
    compiler._grammars.put(small, compiler.grammar(small))
    state = compiler.start(big)  # compiled and used
    assert state.accept(tokenizer.encode("1")[0]), state.error
    assert big not in compiler._grammars and small in compiler._grammars
    assert compiler.grammar(big) == compiler.grammar(big)


def test_compiler_caches_by_value_and_not_errors(compiler):
    spec = GuidedDecoding("regex", "[a-c]+x")
    first = compiler.grammar(spec)
    assert compiler.grammar(GuidedDecoding("regex", "[a-c]+x")) is first
    bad = GuidedDecoding("regex", "a[")
    for _ in range(2):
        with pytest.raises(ValueError):
            compiler.grammar(bad)
    assert bad not in compiler._grammars



def test_warm_up_builds_the_vocabulary_once_and_requests_reuse_it(tokenizer, monkeypatch):
    """The server warms the compiler up while loading (server/app.py): the vocabulary's build
    holds the GIL, so a constrained request must not be the one that pays for it."""
    import llguidance

    from server.app import _warm_structured_outputs

    builds = []
    real = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: builds.append(1) or real(*a, **k))

    class Engine:
        structured_outputs = StructuredOutputCompiler(tokenizer, VOCAB)

    _warm_structured_outputs(Engine)
    assert builds == [1]
    Engine.structured_outputs.prepare(GuidedDecoding("regex", "[0-9]+"))
    Engine.structured_outputs.warm_up()
    assert builds == [1]
    assert StructuredOutputCompiler(None, VOCAB).warm_up() == 0.0  # a model without a tokenizer


def test_the_vocabulary_built_from_the_tokenizers_json_equals_llguidances_own_build(tokenizer):
    """The compiler builds llguidance's tokenizer from the HF tokenizer's JSON without the copy
    llguidance.hf.from_tokenizer makes: the same tokens, special tokens and end of sequence."""
    import llguidance.hf

    ours = StructuredOutputCompiler(tokenizer, VOCAB)._ll_tokenizer
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    text = 'Hello, world! {"a": [1, 2.5e-3, "\\u00e9"]}\n\tdone <|im_end|>'
    assert ours.tokenize_str(text) == theirs.tokenize_str(text) == tokenizer.encode(text, add_special_tokens=False)
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token == theirs.eos_token
    assert [ours.is_special_token(t) for t in range(VOCAB)] == [theirs.is_special_token(t) for t in range(VOCAB)]
    assert ours.decode_bytes(list(range(0, VOCAB, 7))) == theirs.decode_bytes(list(range(0, VOCAB, 7)))


def test_a_failed_warm_up_is_logged_and_not_raised(caplog):
    from server.app import _warm_structured_outputs

    class Broken:
        def warm_up(self):
            raise RuntimeError("no vocabulary")

    class Engine:
        structured_outputs = Broken()

    _warm_structured_outputs(Engine)
    _warm_structured_outputs(object())  # an engine without structured outputs
    assert "could not be prepared" in caplog.text
