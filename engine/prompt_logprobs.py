"""Prompt logprobs: for a request with `params.prompt_logprobs = k`, the logprob of each prompt
token given the tokens before it, and its k best alternatives, in the format of sample logprobs
(one `dict[int, Logprob]` per token, the token first); None for the first token.

Flow in one step: `wanted` picks the request's first prefill, the model runner returns the
logits of all its prompt rows after the usual one-per-sequence rows (`ModelRunner.execute`), and
`assign` turns them into `group.prompt_logprobs`. They are computed once: not again after a
recompute preemption, and shared by the request's n / best_of samples and beams (all forked
from the one prefilled sequence). The block manager gives such requests no prefix-cache hits,
so every prompt row is computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model_runner import StepInput
from engine.outputs import Logprob
from engine.sampler import SampleResult, score_tokens
from engine.scheduler import SchedulerOutput
from engine.sequence import SequenceGroup

Entry = dict[int, Logprob]

# Rows scored at a time: each makes a few full-vocabulary temporaries.
_SCORE_ROWS = 256


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
    logits: torch.Tensor,
    entry: Callable[[SampleResult], Entry],
    on_error: Callable[[SequenceGroup, Exception], None],
) -> None:
    """Set `group.prompt_logprobs` for every sequence of `step` with `all_logits`, from its
    extra rows of `logits`; `entry` builds one token's entry (the engine's decoded format).
    A failure is handed to `on_error(group, exc)` and leaves the other requests alone."""
    row = len(step.seqs)
    for s, seq_in in zip(sched.scheduled, step.seqs):
        if not seq_in.all_logits:
            continue
        n = len(seq_in.token_ids) - 1
        rows, row = logits[row : row + n], row + n
        g = s.group
        try:
            g.prompt_logprobs = score_prompt(g.prompt_token_ids, g.params.prompt_logprobs, seq_in.start, rows, entry)
        except Exception as e:  # one request's failure must not take the others down
            on_error(g, e)


def score_prompt(
    prompt_token_ids: list[int],
    num_top: int,
    start: int,
    logits: torch.Tensor,
    entry: Callable[[SampleResult], Entry],
) -> list[Entry | None]:
    """One entry per prompt token. `logits` row j is the model's output at position
    `start + j`, so it scores prompt token `start + j + 1`; rows past the prompt are ignored.
    Entries are None for position 0 (nothing predicts it) and for positions 1..start, which the
    step did not compute (only a prefix-cache hit skips any, and these requests get none)."""
    out: list[Entry | None] = [None] * min(start + 1, len(prompt_token_ids))
    targets = prompt_token_ids[start + 1 :]
    if logits.shape[0] < len(targets):
        raise RuntimeError(f"{logits.shape[0]} prompt logit rows for {len(targets)} prompt tokens")
    for c in range(0, len(targets), _SCORE_ROWS):
        chunk = targets[c : c + _SCORE_ROWS]
        out.extend(entry(r) for r in score_tokens(logits[c : c + len(chunk)], chunk, num_top))
    return out
