"""The user's sampling settings for one request, validated when built.

Field names follow vLLM's `SamplingParams` so that users (and the OpenAI layer) can map them
one to one. Invalid values raise `RequestError` (a ValueError) with a message fit to show the
user and the field at fault as its `param`. This is the one place each setting's own range (and
the combinations of settings: best_of >= n, beam search's rules) is checked; limits that depend on
the prompt or the model live in engine/core/admission.py, those of the server in server/sampling.py.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field

from engine.core.guided_decoding import GuidedDecoding
from engine.core.request_error import RequestError

_GREEDY_EPS = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer
# What torch.Generator.manual_seed takes: it reads a negative seed modulo 2**64.
_MANUAL_SEED_MIN, _MANUAL_SEED_MAX = -(2**63), 2**64 - 1


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (the engine seeds a
    `random.Random` with it; `torch.Generator().manual_seed` takes it too).

    It is `seed + index` whenever manual_seed takes that (always, for a valid seed and
    0 <= index <= 2**63), so `derive_seed(seed, 0) == seed`; otherwise `seed + index` modulo 2**64,
    which manual_seed also takes. Never raises for integers.
    """
    s = seed + index
    if _MANUAL_SEED_MIN <= s <= _MANUAL_SEED_MAX:
        return s
    return s % 2**64


def _integer(name: str, value, what: str = "an integer") -> int:
    """`value` as a plain int; a bool, a float or anything else that is not an integer is refused."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RequestError(f"{name} must be {what}, got {_show(value)}.", name)


def _number(name: str, value) -> float:
    """`value` as a finite float; a bool, a string, NaN or an infinity is refused."""
    x = None
    if not isinstance(value, (bool, str, bytes)):
        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    if x is None or not math.isfinite(x):
        raise RequestError(f"{name} must be a finite number, got {_show(value)}.", name)
    return x


def _show(value) -> str:
    """`value` for an error message, cut short (an integer may have thousands of digits)."""
    try:
        text = repr(value)
    except ValueError:  # NOTE: Python refuses to print an int of more than 4300 digits
        return "an integer of more than 4300 digits"
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class SamplingParams:
    n: int = 1  # number of sequences returned
    best_of: int | None = None  # sequences generated; the n best by cumulative logprob returned
    presence_penalty: float = 0.0  # OpenAI: subtract once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the generated text
    repetition_penalty: float = 1.0  # CTRL/HF: divide (or multiply) logits of seen tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None  # per-request generator; None uses the engine's global RNG
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    logprobs: int | None = None  # number of top alternatives returned per token (0: only sampled)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Beam search (vLLM's extra fields); beam width is best_of (or n).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Prefix-cache tenant separation: requests with different salts never share cached blocks.
    cache_salt: str | None = None
    # Structured outputs: the output must match this JSON schema / regex / choice / grammar.
    guided_decoding: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [_integer("stop_token_ids", t, "a list of integers") for t in self.stop_token_ids or []]
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check_types()
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        self._verify()

    def _check_types(self) -> None:
        """Every numeric field as a plain int or a finite float (a Python caller may pass NaN,
        an infinity, a bool or a numpy scalar); raises ValueError naming the field."""
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _integer(name, getattr(self, name)))
        for name in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name)))
        floats = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
        for name in floats + ("length_penalty",):
            setattr(self, name, _number(name, getattr(self, name)))

    def _verify(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise RequestError(msg, param)

        if self.n < 1:
            bad("n", f"n must be at least 1, got {_show(self.n)}.")
        if self.best_of < 1:
            bad("best_of", f"best_of must be at least 1, got {_show(self.best_of)}.")
        if self.best_of < self.n:
            bad("best_of", f"best_of must be greater than or equal to n, got n={_show(self.n)} and "
                f"best_of={_show(self.best_of)}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            bad("top_k", f"top_k must be -1 (disable), or at least 1, got {_show(self.top_k)}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {_show(self.max_tokens)}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be greater than or equal to 0, got {_show(self.min_tokens)}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens must be less than or equal to max_tokens={_show(self.max_tokens)}, "
                f"got {_show(self.min_tokens)}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"logprobs must be non-negative, got {_show(self.logprobs)}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"prompt_logprobs must be non-negative, got {_show(self.prompt_logprobs)}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed", f"seed must be a 64-bit signed integer (in [-2**63, 2**63 - 1]), got {_show(self.seed)}.")
        if any(not s for s in self.stop):
            bad("stop", "stop cannot contain an empty string.")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative.")
        for v in self.logit_bias.values():
            if not -100.0 <= v <= 100.0:
                bad("logit_bias", f"logit_bias values must be in [-100, 100], got {v}.")
        if self.use_beam_search:
            if self.best_of < 2:
                bad("best_of" if self.best_of != self.n else "n", "beam search needs a beam width (best_of or n) of at least 2.")
            if self.temperature > _GREEDY_EPS:
                bad("temperature", "beam search requires temperature 0.")
            if self.early_stopping not in (True, False, "never"):
                bad("early_stopping", f"early_stopping must be True, False or 'never', got {self.early_stopping}.")
            if self.guided_decoding is not None:
                bad("use_beam_search", "beam search cannot be combined with structured outputs.")

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These settings with the request's final max_tokens (engine/core/admission.py: a positive
        int that fits the context after the prompt); `self` when it is already that.
        NOTE: a shallow copy, not `dataclasses.replace`, which would validate every field again."""
        if max_tokens == self.max_tokens:
            return self
        final = copy.copy(self)
        final.max_tokens = max_tokens
        return final

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias}; keys may be ints or strings of ints (JSON object keys are strings)."""
    out = {}
    for k, v in (bias or {}).items():
        try:
            tok = int(k, 10) if isinstance(k, str) else _integer("logit_bias", k)
        except ValueError:
            raise RequestError(f"logit_bias keys must be integer token ids, got {_show(k)}.", "logit_bias") from None
        out[tok] = _number("logit_bias", v)
    return out
