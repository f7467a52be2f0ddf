"""What a beam search keeps between steps (`BeamState`, a typed field of its SequenceGroup) and
its finished hypotheses: plain data. The search itself is engine/sample/beam_search.py; the outputs it
reports (the n best hypotheses once done, their text decoded once) are built by
`beam_search_outputs` in engine/loop/output_processor.py.

NOTE: no tokenizer here: `Sequence` imports this module, and the core data type must not pull in
the detokenizer (it did, and closed the circle sequence -> beam_state -> sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import SampleLogprobs


@dataclass
class Hypothesis:
    """A finished beam: its tokens are all the request will keep of it (its blocks are freed)."""

    token_ids: list[int]
    cumulative_logprob: float  # the beam score: sum of the beam log-probabilities
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS or a stop token id) or "length"
    stop_reason: int | None  # the stop token id that ended it, None for EOS or length
    logprobs: SampleLogprobs | None
    text: str | None = None  # decoded once, when first reported


@dataclass
class BeamState:
    """What a beam-search request keeps between steps, stored on its SequenceGroup."""

    width: int  # k: params.best_of
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most k
    done: bool = False
