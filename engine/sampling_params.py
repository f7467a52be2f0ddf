"""The user's sampling settings for one request, validated when built.

Field names follow vLLM's `SamplingParams` so that users (and the OpenAI layer) can map them
one to one. Invalid values raise `ValueError` with a message fit to show the user.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output import GuidedDecoding

_GREEDY_EPS = 1e-5


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
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        self._verify()

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}.")
        if self.best_of < self.n:
            bad(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            bad("stop cannot contain an empty string.")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative.")
        for v in self.logit_bias.values():
            if not -100.0 <= v <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {v}.")
        if self.use_beam_search:
            if self.best_of < 2:
                bad("beam search needs a beam width (best_of or n) of at least 2.")
            if self.temperature > _GREEDY_EPS:
                bad("beam search requires temperature 0.")
            if self.early_stopping not in (True, False, "never"):
                bad(f"early_stopping must be True, False or 'never', got {self.early_stopping}.")
            if self.guided_decoding is not None:
                bad("beam search cannot be combined with structured outputs.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)
