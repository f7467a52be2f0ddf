"""What a beam search keeps between steps (`BeamState`, a typed field of its SequenceGroup) and
the outputs it reports: no choices while it runs, the n best hypotheses once it is done. The
search itself is engine/beam_search.py; this module is what the output processor needs of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import CompletionOutput, SampleLogprobs
from engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from engine.sequence import SequenceGroup


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


def beam_search_outputs(tokenizer, group: "SequenceGroup") -> list[CompletionOutput]:
    """No choices while the search runs (or when it failed or was aborted); once done, the n
    best hypotheses by score, index 0 the best."""
    state = group.beam_state
    if state is None or not state.done:
        return []
    p = group.params
    outs = []
    for i, hyp in enumerate(state.hypotheses[: p.n]):
        if hyp.text is None:
            hyp.text = _decode(tokenizer, group, hyp.token_ids)
        outs.append(
            CompletionOutput(
                index=i,
                text=hyp.text,
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cumulative_logprob,
                logprobs=list(hyp.logprobs) if hyp.logprobs is not None else None,
                finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason,
            )
        )
    return outs


def _decode(tokenizer, group: "SequenceGroup", token_ids: list[int]) -> str:
    """The hypothesis's text exactly as a streamed sequence would have it ("" without a tokenizer)."""
    if tokenizer is None:
        return ""
    p = group.params
    detok = IncrementalDetokenizer(
        tokenizer,
        group.prompt_token_ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
    )
    text = "".join(detok.step(t) for t in token_ids)
    return text + detok.flush()
