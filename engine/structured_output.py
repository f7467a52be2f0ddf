"""Structured outputs: keep sampling inside a JSON schema, a regex, a list of choices or a
grammar.

Each step, every constrained sequence's grammar matcher says which tokens may come next; the
others get -inf logits before sampling, and the sampled token is fed back to the matcher. The
matching itself is llguidance (the Rust library behind structured outputs in vLLM, SGLang and
llama.cpp): it compiles JSON schemas, regexes and Lark/GBNF grammars against the tokenizer's
vocabulary and computes a step's mask in tens of microseconds, so we do not write our own.

The pieces:
- `GuidedDecoding`, the user's constraint, a small frozen value carried in `SamplingParams`.
- `StructuredOutputCompiler`, one per engine: turns a constraint into a validated grammar
  (bad schemas and regexes raise `ValueError` with llguidance's message, for a 400) and
  starts a `GrammarState` from it.
- `GrammarState`, one per sequence: accepts tokens, forks with the sequence (n > 1), and says
  when the grammar is complete so that the sequence can stop.
- `apply_grammar_masks`, which masks a batch's logits rows in place.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must match. `kind` is one of:
    - "json": `value` is a JSON schema, serialised (`{"type": "object"}` means any object);
    - "regex": `value` is a regular expression the whole output must match (Rust syntax);
    - "choice": `value` is a JSON list of strings, the output is exactly one of them;
    - "grammar": `value` is a Lark or GBNF (llama.cpp) grammar.
    """

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(KINDS)}, got {self.kind!r}.")
        if not isinstance(self.value, str):
            raise ValueError(f"guided decoding value must be a string, got {type(self.value).__name__}.")

    @classmethod
    def json_schema(cls, schema: dict | str | None = None) -> "GuidedDecoding":
        """Any JSON object when `schema` is None."""
        if schema is None:
            schema = {"type": "object"}
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> "GuidedDecoding":
        return cls("choice", json.dumps(list(choices)))


def _grammar_text(spec: GuidedDecoding) -> str:
    """The llguidance grammar for `spec`; raises ValueError on input llguidance cannot parse."""
    import llguidance

    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object.")
        # NOTE: whitespace_flexible=False keeps JSON compact, one space after ':' and ','
        # excepted: a small model allowed free whitespace can pad forever.
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the choices are not a JSON list: {e}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings.")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.grammar_from("grammar", spec.value)


def validate(spec: GuidedDecoding, ll_tokenizer=None) -> str:
    """The llguidance grammar for `spec`, checked (against `ll_tokenizer` when given, which
    also catches tokenizer-specific problems); raises ValueError with the reason."""
    import llguidance

    text = _grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer)
    if is_error:
        raise ValueError(f"invalid {spec.kind} constraint: {messages[0].strip()}")
    return text


class ConstraintUnsatisfiable(ValueError):
    """The grammar rejected a token its own mask allowed: the constraint cannot be met with
    this vocabulary (e.g. a regex demanding a byte no token holds). The request's fault, a 400."""


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe; the engine thread owns it."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher  # llguidance.LLMatcher

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (for a forked sequence)."""
        return GrammarState(self._matcher.deep_copy())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False when the grammar rejects it (the state is then
        in error and stays there). The masks allow only tokens the grammar takes, so that
        happens only when the constraint cannot be met with this vocabulary."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The output matches and nothing more may follow: the sequence should stop."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into `bitmask[row]` (int32, CPU, 32 tokens a word)."""
        v = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


class StructuredOutputCompiler:
    """Compiles constraints against one tokenizer; compiled grammars are cached by value."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits width of the model

    @functools.cached_property
    def _ll_tokenizer(self):
        """Built on first use (about 0.5 s for a 50k vocabulary)."""
        import llguidance.hf

        if self._hf_tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (this model has none).")
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one compiler per engine, lives as long
    def grammar(self, spec: GuidedDecoding) -> str:
        """The validated grammar for `spec`; raises ValueError with the reason if it is bad."""
        return validate(spec, self._ll_tokenizer)

    def start(self, spec: GuidedDecoding) -> GrammarState:
        """A fresh state at the start of `spec`'s grammar."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return GrammarState(matcher)


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
    """Set to -inf, in place, the logits of every token that `state` does not allow next, for
    each `(row, state)`. Rows not listed, and states in error (whose sequence will fail on its
    next token), are left alone."""
    rows = [(r, state) for r, state in rows if state.error is None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    for i, (_, state) in enumerate(rows):
        state.fill_mask(bitmask, i)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor([r for r, _ in rows], dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
