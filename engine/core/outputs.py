"""What the engine hands back to its callers after each step: plain, picklable dataclasses.

What a `RequestOutput` holds depends on the request's `OutputKind`: everything so far
(CUMULATIVE), only what is new since the request's previous output (DELTA: streaming), or one
output when the request is done (FINAL_ONLY).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # each step: each choice's text, tokens and logprobs so far
    DELTA = "delta"  # each step with news: only the new text, tokens and logprob entries
    FINAL_ONLY = "final"  # nothing until the request finishes, then everything


@dataclass(slots=True)
class Logprob:
    logprob: float  # the model's log-probability of this token (raw logits, before sampling settings)
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, the sampled token first, then the top
# alternatives by rank. None when the request asked for no logprobs.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n choices this is
    text: str  # the text generated so far (DELTA: since the last output); stop string removed unless kept
    token_ids: list[int]  # the tokens generated so far (DELTA: the new ones)
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # one entry per token of token_ids
    finish_reason: str | None = None  # None while running; "stop" or "length" (an aborted request has none)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: "RequestMetrics | None" = None
    error: str | None = None  # set when this request failed inside the engine (the server answers 500)
    invalid_request: bool = False  # ... because of the request itself, e.g. an unsatisfiable constraint (400)
    delta: bool = False  # the choices hold only what is new (OutputKind.DELTA)



@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic()) and sizes of one request, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time
