"""Beam search inside the engine: beams are sequences of one request that fork and drop block
tables through copy-on-write, so a beam that continues two ways shares every block but its last.

The choice of beams follows HF transformers 5.x `generate(num_beams=k, do_sample=False)`:

- Each step scores every running beam's next tokens by cumulative log-probability (the
  log_softmax of the logits after logit bias, masks and penalties, added in float32 to the
  beam's score; NaN, from a row with every token masked, counts as -inf) and ranks the
  candidates over all beams, best first. HF keeps the best `2k` (`max(2, 1 + the number of
  stop tokens) * k` when stop_token_ids add more ways to end); only the best `k` that end and
  the best `k` that continue matter, so those are all that are looked at.
- A candidate that ends its beam (EOS or a stop token id, or the `max_tokens`-th token) becomes
  a finished hypothesis if it is among the best `k` candidates, scored
  `sum_logprobs / generated_len ** length_penalty` (generated_len counts the EOS). Only the
  `k` best hypotheses are kept.
- The best `k` candidates that do not end become the next beams.
- The search is done when the `max_tokens`-th token was drawn (every candidate ends); or, once
  `k` hypotheses exist, with `early_stopping=True` at once, and otherwise when no running beam
  can beat the worst hypothesis: the best running score divided by `L ** length_penalty` is
  no better than it, where L is the beams' current length, or `max_tokens` when
  `early_stopping="never"` and `length_penalty > 0`.
- The first step (the prompt) has one sequence, so all candidates come from it (HF starts with
  k equal beams whose copies are scored -1e9).

Stop strings are not applied: beams are compared token by token, as in HF. Per-token logprobs,
when asked for, are the raw model's (as for sampling), not the beam scores.

Outputs: while the search runs, a request returns no choices (its beams change under it, so
streaming text deltas would make no sense, like best_of); when it is done, the n best
hypotheses by score, index 0 the best.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.beam_state import BeamState, Hypothesis
from engine.core.outputs import Logprob
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.step import SampleResult
from engine.sample.sampler import score_tokens


def _state(group: SequenceGroup) -> BeamState:
    if group.beam_state is None:
        group.beam_state = BeamState(width=group.params.best_of)
    return group.beam_state


@dataclass
class BeamDecision:
    """What one step decided, for the engine to apply to the KV blocks (the scheduler's
    `update_from_output`): beams forked (they share their parent's blocks) and beams dropped
    (their blocks are freed). The beams' tokens and the request's state are already updated."""

    num_new_tokens: int = 0  # tokens appended to beams or hypotheses
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child)
    dropped: list[Sequence] = field(default_factory=list)


@dataclass(frozen=True)
class BeamContext:
    """What a beam step needs from the engine, passed in rather than reached for."""

    # (raw rows, request, its beams) -> float32 logits after logit bias, masks and penalties
    adjusted_logits: Callable[[torch.Tensor, SequenceGroup, list[Sequence]], torch.Tensor]
    logprob_entry: Callable[[SampleResult], dict[int, Logprob]]  # a scored token -> its logprobs entry
    eos_token_id: int | None


@dataclass
class _Candidate:
    parent: Sequence
    row: int  # the parent's index in this request's beams (and rows of `raw`)
    token_id: int
    score: float  # the parent's beam score plus this token's log-probability (float32)


def beam_search_step(ctx: BeamContext, group: SequenceGroup, seq_rows: list[tuple[Sequence, int]],
                     logits: torch.Tensor) -> BeamDecision:
    """One beam-search step for one request: choose the next beams and hypotheses from this
    step's logits and apply the choice to the request's sequences.

    `seq_rows` are the request's running beams with their row in `logits` ([scheduled, vocab]
    float32). Mutates: beams' tokens and scores; forks children (copies of their parent) into
    `group.seqs`; removes beams that were not chosen; when the search is done, marks the
    remaining beams finished. Touches no blocks: the returned decision says which beams forked
    and which were dropped.
    """
    state = _state(group)
    p = group.params
    k = state.width
    unscheduled = [s for s in group.unfinished_seqs if all(s is not seq for seq, _ in seq_rows)]
    if unscheduled:
        raise RuntimeError(f"beams {unscheduled} of request {group.request_id} were not scheduled with the others")

    seqs = [seq for seq, _ in seq_rows]
    rows = torch.tensor([row for _, row in seq_rows], dtype=torch.long, device=logits.device)
    raw = logits.index_select(0, rows)
    adjusted = ctx.adjusted_logits(raw, group, seqs)
    beam_scores = torch.tensor([seq.cumulative_logprob for seq in seqs], dtype=torch.float32, device=logits.device)
    scores = torch.log_softmax(adjusted, dim=-1) + beam_scores[:, None]
    # NOTE: torch.topk ranks NaN above everything; a row of -inf logits gives NaN.
    scores.masked_fill_(scores.isnan(), float("-inf"))

    stop_ids = set(p.stop_token_ids)
    if ctx.eos_token_id is not None and not p.ignore_eos:
        stop_ids.add(ctx.eos_token_id)
    candidates = [_Candidate(seqs[r], r, t, v) for r, t, v in select_candidates(scores, stop_ids, k)]

    next_beams: list[_Candidate] = []
    decision = BeamDecision()
    for rank, c in enumerate(candidates):
        n_out = len(c.parent.output_token_ids) + 1
        is_stop = c.token_id in stop_ids
        if is_stop or n_out >= group.params.max_tokens:
            # NOTE: HF only lets the best k candidates finish; the rest are a reserve of beams.
            if rank < k:
                _add_hypothesis(ctx, state, group, c, raw, is_stop)
                decision.num_new_tokens += 1
        elif len(next_beams) < k:
            next_beams.append(c)

    state.done = not next_beams or _search_done(state, group, next_beams)
    if state.done:
        best = state.hypotheses[0]
        status = SequenceStatus.FINISHED_STOPPED if best.finish_reason == "stop" else SequenceStatus.FINISHED_LENGTH
        for seq in seqs:
            seq.status = status
        return decision
    _apply(ctx, group, seqs, next_beams, raw, decision)
    decision.num_new_tokens += len(next_beams)
    return decision


def _search_done(state: BeamState, group: SequenceGroup, next_beams: list[_Candidate]) -> bool:
    """HF's stopping rule once k hypotheses exist: early_stopping=True stops at once; otherwise
    stop when the best running beam cannot beat the worst hypothesis (HF's heuristic)."""
    p = group.params
    if len(state.hypotheses) < state.width:
        return False
    if p.early_stopping is True:
        return True
    if p.early_stopping == "never" and p.length_penalty > 0.0:
        best_len = group.params.max_tokens
    else:
        best_len = len(next_beams[0].parent.output_token_ids) + 1
    best_possible = _normalized(next_beams[0].score, best_len, p.length_penalty)
    return best_possible <= state.hypotheses[-1].score


def select_candidates(scores: torch.Tensor, stop_ids: set[int], k: int) -> list[tuple[int, int, float]]:
    """(row, token id, score) of the candidates a step needs from `scores` ([beams, vocab],
    no NaN), best first: the best k whose token is not in `stop_ids` and the best k whose token
    is. Those hold every candidate ranked < k overall (the only ones that may become
    hypotheses) and the best k that continue (the next beams), in the order of a full ranking,
    at most 2k of them whatever the number of stop ids. Equal scores are listed by row, then
    token (which of several equal scores at the k-th place are taken is torch.topk's choice).
    """
    vocab = scores.shape[1]
    stop = sorted(t for t in stop_ids if 0 <= t < vocab)
    if stop:
        is_stop = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
        stop_cols = torch.tensor(stop, dtype=torch.long, device=scores.device)
        is_stop[stop_cols] = True
        found = _best(scores, (~is_stop).nonzero()[:, 0], k) + _best(scores, stop_cols, k)
    else:
        found = _best(scores, None, k)
    # NOTE: -inf scores (masked tokens) are equal; the row/token order keeps the ranking stable.
    found.sort(key=lambda c: (-c[2], c[0], c[1]))
    return found


def _best(scores: torch.Tensor, cols: torch.Tensor | None, k: int) -> list[tuple[int, int, float]]:
    """The k best (row, token id, score) of `scores` restricted to the columns `cols` (None: all)."""
    sub = scores if cols is None else scores.index_select(1, cols)
    width = sub.shape[1]
    if sub.numel() == 0 or k <= 0:
        return []
    values, flat = torch.topk(sub.reshape(-1), min(k, sub.numel()))
    tokens = flat % width if cols is None else cols[flat % width]
    return list(zip((flat // width).tolist(), tokens.tolist(), values.tolist()))


def _normalized(score: float, length: int, length_penalty: float) -> float:
    """score / length ** length_penalty, computed in float32 as HF's score tensors are, so
    that comparisons agree with it to the last bit. Never NaN (0 / 0 and inf / inf give -inf)
    and never raises for a finite length_penalty."""
    try:
        denominator = length ** float(length_penalty)
    except OverflowError:  # e.g. 2 ** 1e308; a float32 division by it would see inf anyway
        denominator = float("inf")
    out = (torch.tensor(score, dtype=torch.float32) / denominator).item()
    return float("-inf") if math.isnan(out) else out


def _add_hypothesis(
    ctx: BeamContext, state: BeamState, group: SequenceGroup, c: _Candidate, raw: torch.Tensor, is_stop: bool
) -> None:
    p = group.params
    token_ids = c.parent.output_token_ids + [c.token_id]
    logprobs = None
    if p.logprobs is not None:
        logprobs = list(c.parent.output_logprobs) + [_logprob_entry(ctx, raw[c.row], c.token_id, p.logprobs)]
    hyp = Hypothesis(
        token_ids=token_ids,
        cumulative_logprob=c.score,
        score=_normalized(c.score, len(token_ids), p.length_penalty),
        finish_reason="stop" if is_stop else "length",
        stop_reason=c.token_id if is_stop and c.token_id != ctx.eos_token_id else None,
        logprobs=logprobs,
    )
    hyps = state.hypotheses
    hyps.append(hyp)
    # NOTE: a stable sort keeps the earlier of two equal scores first, as HF's merge does.
    hyps.sort(key=lambda h: h.score, reverse=True)
    del hyps[state.width :]


def _apply(ctx: BeamContext, group: SequenceGroup, seqs: list[Sequence], next_beams: list[_Candidate],
           raw: torch.Tensor, decision: BeamDecision) -> None:
    """Turn the chosen candidates into the request's beams: a parent's first child continues
    the parent's own Sequence; further children fork it (`decision.forks`: they will share its
    blocks); parents with no child leave the request (`decision.dropped`)."""
    p = group.params
    taken: set[int] = set()
    growing: list[tuple[Sequence, _Candidate]] = []
    # Fork first: a child copies its parent before the parent's own next token is appended.
    for c in next_beams:
        if c.parent.seq_id not in taken:
            taken.add(c.parent.seq_id)
            growing.append((c.parent, c))
            continue
        child = c.parent.fork(c.parent.index, None)
        decision.forks.append((c.parent, child))
        group.seqs.append(child)
        growing.append((child, c))
    for seq, c in growing:
        seq.output_token_ids.append(c.token_id)
        seq.cumulative_logprob = c.score
        if p.logprobs is not None:
            seq.output_logprobs.append(_logprob_entry(ctx, raw[c.row], c.token_id, p.logprobs))
    for seq in seqs:
        if seq.seq_id not in taken:
            decision.dropped.append(seq)
            group.seqs.remove(seq)
    for i, (seq, _) in enumerate(growing):
        seq.index = i


def _logprob_entry(ctx: BeamContext, raw_row: torch.Tensor, token_id: int, num_top: int) -> dict[int, Logprob]:
    """The same per-token entry as sampling gives: the raw model's logprob and rank of the
    token, then its `num_top` best alternatives."""
    return ctx.logprob_entry(score_tokens(raw_row[None, :], [token_id], num_top)[0])
