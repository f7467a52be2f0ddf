"""Prompt logprobs: for a request with `params.prompt_logprobs = k`, the logprob of each prompt
token given the tokens before it, and its k best alternatives, in the format of sample logprobs
(one `dict[int, Logprob]` per token, the token first); None for the first token.

Computed chunk by chunk, as the prompt is prefilled (chunked prefill cuts such a request's
prompt like any other's, so it cannot hold a step past the token budget): `wanted` picks the
chunks of a pending request's lead sequence; the model runner scores each chunk's rows, every
row the prompt token after it, the chunk's last row included unless the chunk ends the prompt
(`SeqInput.score_next`), running the LM head a bounded number of rows at a time and keeping only
each token's logprob, rank and top k (`ModelRunner.execute`, `StepOutput.prompt_scores`);
`assign` appends the new positions' entries to `group.prompt_logprobs_so_far` and, at the chunk
that ends the prompt, sets `group.prompt_logprobs`. A position is scored once: a chunk run again
after a recompute preemption re-scores rows whose entries exist, and those are ignored; the
prefix cache serves such a request only the tokens before its last scored position
(`SequenceGroup.cacheable_prompt_tokens`). The entries are shared by the request's n / best_of
samples and beams (all forked from the one prefilled sequence). Their alternatives' texts are
not decoded here (`Logprob.decoded_token` is None): the server decodes them off the engine
thread.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.outputs import Logprob
from engine.core.sequence import SequenceGroup
from engine.core.step import SampleResult, SchedulerOutput, StepInput

Entry = dict[int, Logprob]


def wanted(sched: SchedulerOutput) -> dict[int, int]:
    """Indices in `sched.scheduled` of the prefill chunks that score prompt logprobs (the lead
    sequence's chunks while its request's are pending), each mapped to the prompt token after
    the chunk, which its last row scores too (-1 when the chunk ends the prompt)."""
    want: dict[int, int] = {}
    for i, s in enumerate(sched.scheduled):
        g = s.group
        if s.is_prefill and g.prompt_logprobs_pending and s.seq is g.seqs[0]:
            end = s.start + s.num_tokens
            prompt = g.prompt_token_ids
            want[i] = prompt[end] if end < len(prompt) else -1
    return want


def entry(result: SampleResult) -> Entry:
    """One prompt token's entry: the token first (its own rank), then its top alternatives by
    rank (a token already listed keeps its first entry); no decoded texts."""
    t = result.token_id
    out = {t: Logprob(result.logprob, result.rank)}
    for rank, (tid, lp) in enumerate(result.top_logprobs or [], start=1):
        out.setdefault(tid, Logprob(lp, rank))
    return out


def assign(
    sched: SchedulerOutput,
    step: StepInput,
    scores: list[list[SampleResult] | None],
    on_error: Callable[[SequenceGroup, Exception], None],
) -> None:
    """Gather the scores of every sequence of `step` that has them (the step's
    `StepOutput.prompt_scores`) on its request; set `group.prompt_logprobs` once the prompt's
    last chunk has run. A failure is handed to `on_error(group, exc)` and leaves the other
    requests alone."""
    for s, seq_in, seq_scores in zip(sched.scheduled, step.seqs, scores):
        if seq_scores is None:
            continue
        g = s.group
        try:
            extend(g.prompt_logprobs_so_far, g.prompt_token_ids, seq_in.start, seq_scores)
            if seq_in.start + len(seq_in.token_ids) >= len(g.prompt_token_ids):
                if len(g.prompt_logprobs_so_far) != len(g.prompt_token_ids):
                    raise RuntimeError(f"{len(g.prompt_logprobs_so_far)} prompt logprobs for "
                                       f"{len(g.prompt_token_ids)} prompt tokens")
                g.prompt_logprobs = g.prompt_logprobs_so_far
        except Exception as e:  # one request's failure must not take the others down
            on_error(g, e)


def extend(so_far: list[Entry | None], prompt_token_ids: list[int], start: int,
           scores: list[SampleResult]) -> None:
    """Append to `so_far` (entries for prompt positions 0..len(so_far)-1) the entries of the
    positions `scores` adds: `scores[j]` scores the token at position `start + j + 1`; positions
    already held and those past the prompt are ignored. Raises if the scores leave a gap or are
    not of the prompt's tokens."""
    first = start + 1  # the position scores[0] scores
    if first > len(so_far):
        raise RuntimeError(f"prompt logprobs from position {first} with {len(so_far)} computed")
    targets = prompt_token_ids[first:first + len(scores)]
    if [r.token_id for r in scores[:len(targets)]] != targets:
        raise RuntimeError("the scored tokens are not the prompt's")
    so_far.extend(entry(r) for r in scores[len(so_far) - first:len(targets)])
