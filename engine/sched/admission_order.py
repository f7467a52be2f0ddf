"""The order in which the scheduler's step (2) brings requests in (`admission_queue`).

`scheduling_policy="fcfs"`: every request that is out (swapped, waiting, a parked lead) by
priority: first come, first served.

`scheduling_policy="shortest-prompt"` (the default): requests that have run before (swapped, parked leads,
preempted ones waiting to be recomputed) still come back first, by priority: their streams are
already open. Then fresh requests, fewest prompt tokens first, looked for among the first
`max_num_seqs` fresh requests by arrival (NOTE: so a step sorts at most that many, however long
the queue; the rest follow in arrival order). When many prompts arrive together, the short ones
get their first token after their own prefill, not after every longer prompt ahead of them:
shortest job first minimises the mean and median wait.

The same holds for chunked prefill (shortest remaining first): under shortest-prompt a running
request part way through a prompt longer than the shortest fresh one takes its next chunk
after step (2) (`chunks_after`), so a short prompt that arrives while a long one is being
prefilled is not queued behind the long one's remaining chunks.

Why a long prompt is not starved: the scheduler's liveness bound never used the order among
requests other than the oldest. Step (0) brings the oldest request in whatever its length, and
step (1) runs it first, so a request finishes within W steps of becoming the oldest, as under
FCFS (tests/engine/test_liveness.py draws the policy). What a long prompt gives up is its place
among the newer short ones until then.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

from engine.core.sequence import SequenceGroup


def _priority(group: SequenceGroup) -> tuple:
    return group.priority


def _prompt_first(group: SequenceGroup) -> tuple:
    return (len(group.prompt_token_ids), group.priority)


def admission_queue(policy: str, window: int, swapped: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup],
                    parked_leads: Iterable[SequenceGroup]) -> list[SequenceGroup]:
    """The requests that are out, in the order step (2) tries them (it stops at the first that
    does not fit). `waiting` in priority order; `window`: how many fresh requests are sorted by
    prompt length (shortest-prompt)."""
    if policy == "fcfs":
        return sorted(chain(swapped, waiting, parked_leads), key=_priority)
    resumed: list[SequenceGroup] = [*swapped, *parked_leads]
    fresh: list[SequenceGroup] = []
    rest = iter(waiting)
    for group in rest:
        # NOTE: a request preempted whole has num_preemptions > 0; a fresh one has never run
        (resumed if group.num_preemptions else fresh).append(group)
        if len(fresh) == window:
            break
    later = list(rest)
    resumed.extend(g for g in later if g.num_preemptions)
    resumed.sort(key=_priority)
    fresh.sort(key=_prompt_first)
    return resumed + fresh + [g for g in later if not g.num_preemptions]


def chunks_after(policy: str, queue: list[SequenceGroup]) -> int | None:
    """How many uncomputed prompt tokens a running request's next chunk may have and still go
    before step (2)'s admissions (`StepPlan.schedule_chunks`' `defer_over`): under
    shortest-prompt the length of the shortest fresh prompt in `queue` (its first fresh one);
    None (every chunk first) under fcfs or when no fresh request waits."""
    if policy == "fcfs":
        return None
    for group in queue:
        if not group.num_preemptions:  # NOTE: fresh, as in admission_queue
            return len(group.prompt_token_ids)
    return None
