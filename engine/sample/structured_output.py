"""Structured outputs: keep sampling inside a JSON schema, a regex, a list of choices or a
grammar.

Each step, every constrained sequence's grammar matcher says which tokens may come next; the
others get -inf logits before sampling, and the sampled token is fed back to the matcher. The
matching itself is llguidance (the Rust library behind structured outputs in vLLM, SGLang and
llama.cpp): it compiles JSON schemas, regexes and Lark/GBNF grammars against the tokenizer's
vocabulary and computes a step's mask in tens of microseconds, so we do not write our own.

The pieces:
- `GuidedDecoding` (engine/core/guided_decoding.py), the user's constraint, a small frozen value
  carried in `SamplingParams`.
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
import sys
import threading
import time
from collections import OrderedDict

import torch

from engine.core.guided_decoding import GuidedDecoding

logger = logging.getLogger(__name__)

# The compiled-grammar cache of a compiler holds at most this many grammars, and at most this
# many bytes of constraint and grammar text (a user's schema can be megabytes).
GRAMMAR_CACHE_ENTRIES = 256
GRAMMAR_CACHE_BYTES = 64 << 20


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


# A step's mask for one sequence normally takes microseconds. A constraint whose masks take
# longer than this (a regex such as "(a{1000}){1000}" takes ~1 s for its first and ~0.2 s for
# each next one) would slow every request in the batch: it fails alone with a 400.
MAX_FIRST_MASK_S = 0.25  # checked off the engine thread, before the request is queued
MAX_STEP_MASK_S = 0.05  # checked at every step


class ConstraintTooComplex(ConstraintUnsatisfiable):
    """The constraint's masks take too long to compute (the request's fault, a 400)."""


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe: one thread at a time (the
    server's input worker prepares it, then hands it to the engine thread)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self.slow_mask_s: float | None = None  # set when a step's mask took over MAX_STEP_MASK_S

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


class GrammarCache:
    """A least-recently-used map from constraint to grammar text, bounded by entries and by
    bytes (`entry_bytes`); an entry larger than the byte bound alone is never stored.
    Thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[GuidedDecoding, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, spec: GuidedDecoding) -> bool:
        return spec in self._entries

    def get(self, spec: GuidedDecoding) -> str | None:
        with self._lock:
            text = self._entries.get(spec)
            if text is not None:
                self._entries.move_to_end(spec)
            return text

    def put(self, spec: GuidedDecoding, text: str) -> None:
        size = entry_bytes(spec, text)
        if size > self.max_bytes or self.max_entries <= 0:
            return
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self.bytes -= entry_bytes(spec, old)
            self._entries[spec] = text
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                evicted, evicted_text = self._entries.popitem(last=False)
                self.bytes -= entry_bytes(evicted, evicted_text)


def entry_bytes(spec: GuidedDecoding, text: str) -> int:
    """What a cached grammar costs: the memory of its constraint's and its grammar's text."""
    return sys.getsizeof(spec.value) + sys.getsizeof(text)


class StructuredOutputCompiler:
    """Compiles constraints against one tokenizer; compiled grammars are cached by value."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits width of the model
        self._grammars = GrammarCache(GRAMMAR_CACHE_ENTRIES, GRAMMAR_CACHE_BYTES)

    @functools.cached_property
    def _ll_tokenizer(self):
        """Built on first use (about 0.5 s for a 50k vocabulary)."""
        import llguidance.hf

        if self._hf_tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (this model has none).")
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            # NOTE: llguidance.hf.from_tokenizer first copies the Rust tokenizer to switch its
            # padding and truncation off (0.6 of its 0.9 s here, and ~10 MB that stay in the
            # heap); with neither set, the tokenizer's own JSON is the same.
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                          eos_token=self._hf_tokenizer.eos_token_id)
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    def warm_up(self) -> float:
        """Build the vocabulary's llguidance tokenizer now; returns the seconds it took (0.0
        when the model has no tokenizer). The server calls this while loading."""
        # NOTE: the build holds the GIL for about a quarter of a second at a stretch; built
        # lazily, on the first constrained request, it froze every other stream and the event
        # loop for as long.
        if self._hf_tokenizer is None:
            return 0.0
        t0 = time.perf_counter()
        self._ll_tokenizer
        return time.perf_counter() - t0

    def grammar(self, spec: GuidedDecoding) -> str:
        """The validated grammar for `spec`; raises ValueError with the reason if it is bad
        (a bad constraint is not cached, it is checked again when it comes back)."""
        text = self._grammars.get(spec)
        if text is None:
            text = validate(spec, self._ll_tokenizer)
            self._grammars.put(spec, text)
        return text

    def start(self, spec: GuidedDecoding) -> GrammarState:
        """A fresh state at the start of `spec`'s grammar."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return GrammarState(matcher)

    def prepare(self, spec: GuidedDecoding, max_first_mask_s: float = MAX_FIRST_MASK_S) -> GrammarState:
        """`start`, plus its first mask computed once and timed (the server calls this off the
        engine thread; the state's matcher keeps what it built). Raises ConstraintTooComplex
        when that mask takes longer than `max_first_mask_s`."""
        state = self.start(spec)
        scratch = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        t0 = time.perf_counter()
        state.fill_mask(scratch, 0)
        elapsed = time.perf_counter() - t0
        if elapsed > max_first_mask_s:
            raise ConstraintTooComplex(
                f"the {spec.kind} constraint is too complex: its first token mask took {elapsed * 1e3:.0f} ms "
                f"(the limit is {max_first_mask_s * 1e3:.0f} ms); simplify it.")
        return state


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
        t0 = time.perf_counter()
        state.fill_mask(bitmask, i)
        elapsed = time.perf_counter() - t0
        if elapsed > MAX_STEP_MASK_S:
            state.slow_mask_s = elapsed  # NOTE: the engine fails its request after this step
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor([r for r, _ in rows], dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
