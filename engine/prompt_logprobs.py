"""Prompt logprobs: for a request with `params.prompt_logprobs = k`, the logprob of each prompt
token given the tokens before it, and its k best alternatives, in the format of sample logprobs
(one `dict[int, Logprob]` per token, the token first); None for the first token.

Flow in one step: `wanted` picks the request's first prefill; the model runner scores all its
prompt tokens, running the LM head a bounded chunk of rows at a time and keeping only each
token's logprob, rank and top k (`ModelRunner.execute`, `StepOutput.prompt_scores`); `assign`
turns those scores into `group.prompt_logprobs`. They are computed once: not again after a
recompute preemption, and shared by the request's n / best_of samples and beams (all forked
from the one prefilled sequence). The block manager gives such requests no prefix-cache hits,
so every prompt row is computed.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.model_runner import StepInput
from engine.outputs import Logprob
from engine.sampler import SampleResult
from engine.scheduler import SchedulerOutput
from engine.sequence import SequenceGroup

Entry = dict[int, Logprob]


def wanted(sched: SchedulerOutput) -> set[int]:
    """Indices in `sched.scheduled` of prefills whose request asked for prompt logprobs and has
    none yet (its first prefill: one sequence, so at most one index per request)."""
    want: set[int] = set()
    groups: set[int] = set()
    for i, s in enumerate(sched.scheduled):
        g = s.group
        if s.is_prefill and g.params.prompt_logprobs is not None and g.prompt_logprobs is None:
            if id(g) not in groups:
                groups.add(id(g))
                want.add(i)
    return want


def assign(
    sched: SchedulerOutput,
    step: StepInput,
    scores: list[list[SampleResult] | None],
    entry: Callable[[SampleResult], Entry],
    on_error: Callable[[SequenceGroup, Exception], None],
) -> None:
    """Set `group.prompt_logprobs` for every sequence of `step` that has `scores` (the step's
    `StepOutput.prompt_scores`); `entry` builds one token's entry (the engine's decoded
    format). A failure is handed to `on_error(group, exc)` and leaves the other requests alone."""
    for s, seq_in, seq_scores in zip(sched.scheduled, step.seqs, scores):
        if seq_scores is None:
            continue
        g = s.group
        try:
            g.prompt_logprobs = prompt_entries(g.prompt_token_ids, seq_in.start, seq_scores, entry)
        except Exception as e:  # one request's failure must not take the others down
            on_error(g, e)


def prompt_entries(
    prompt_token_ids: list[int],
    start: int,
    scores: list[SampleResult],
    entry: Callable[[SampleResult], Entry],
) -> list[Entry | None]:
    """One entry per prompt token. `scores[j]` scores the token at position `start + j + 1`
    (under the model's output at `start + j`); scores past the prompt are ignored. Entries are
    None for position 0 (nothing predicts it) and for positions 1..start, which the step did not
    compute (only a prefix-cache hit skips any, and these requests get none)."""
    out: list[Entry | None] = [None] * min(start + 1, len(prompt_token_ids))
    targets = prompt_token_ids[start + 1 :]
    if len(scores) < len(targets):
        raise RuntimeError(f"{len(scores)} prompt token scores for {len(targets)} prompt tokens")
    scores = scores[: len(targets)]
    if [r.token_id for r in scores] != targets:
        raise RuntimeError("the scored tokens are not the prompt's")
    out.extend(entry(r) for r in scores)
    return out
