"""The order in which step (2) brings requests in (engine/sched/admission_order.py), on its own and
through the real Scheduler and BlockManager (no model). The liveness walk in
tests/engine/test_liveness.py draws the policy too."""

from __future__ import annotations

import pytest

from engine.core.config import SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.kv.block_manager import BlockManager
from engine.sched import admission_order
from engine.sched.admission_order import admission_queue
from engine.sched.scheduler import Scheduler
from tests.engine.test_scheduler import fake_step


def group(rid: str, n_tokens: int, t: float, max_tokens: int = 4) -> SequenceGroup:
    g = SequenceGroup(rid, None, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=max_tokens), t)
    return g


def ids(groups) -> list[str]:
    return [g.request_id for g in groups]


def test_fcfs_is_priority_order_across_the_queues():
    swapped, waiting, parked = [group("s", 5, 2.0)], [group("w1", 2, 1.0), group("w3", 9, 3.0)], [group("p", 1, 0.5)]
    assert ids(admission_queue("fcfs", 8, swapped, waiting, parked)) == ["p", "w1", "s", "w3"]


def test_shortest_prompt_resumes_requests_that_ran_then_fresh_ones_by_length():
    fresh = [group("long", 40, 0.0), group("mid", 12, 1.0), group("short", 3, 2.0), group("tie", 12, 3.0)]
    preempted = group("pre", 50, 4.0)
    preempted.num_preemptions = 1  # recomputed: it streamed before
    waiting = [*fresh[:2], preempted, *fresh[2:]]
    queue = admission_queue("shortest-prompt", 8, [group("sw", 30, 5.0)], waiting, [group("pk", 20, 6.0)])
    assert ids(queue) == ["pre", "sw", "pk", "short", "mid", "tie", "long"]


def test_shortest_prompt_sorts_only_a_window_of_fresh_requests(monkeypatch):
    """However long the queue, a step sorts at most `window` fresh requests (counted: the sort
    key's calls); the rest keep their arrival order, behind them."""
    calls = []
    key = admission_order._prompt_first
    monkeypatch.setattr(admission_order, "_prompt_first", lambda g: calls.append(g) or key(g))
    waiting = [group(f"r{i}", 100 - i % 50, float(i)) for i in range(5000)]
    queue = admission_queue("shortest-prompt", 4, [], waiting, [])
    assert len(calls) == 4
    assert ids(queue[:4]) == ["r3", "r2", "r1", "r0"] and queue[4:] == waiting[4:]


def make_scheduler(policy: str, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_seqs, budget, 64, "swap", 8, enable_chunked_prefill=True, scheduling_policy=policy)
    return Scheduler(cfg, BlockManager(64, 0, 4))


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prompt"])
def test_a_burst_gets_short_prompts_first_but_never_holds_back_the_oldest(policy):
    """Four prompts arrive together: the oldest (40 tokens) samples first under either policy
    (liveness); after it, fcfs prefills by arrival, shortest-prompt the short ones first."""
    sched = make_scheduler(policy)
    for g in (group("oldest", 40, 0.0), group("b-long", 30, 1.0), group("c-short", 3, 2.0), group("d-short", 5, 3.0)):
        sched.add(g)
    first_token: dict[str, int] = {}
    for step in range(1, 40):
        out, _ = fake_step(sched)
        for s in out.scheduled:
            if s.samples and s.seq.output_token_ids == [99]:
                first_token.setdefault(s.group.request_id, step)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and sched.block_manager.device.num_free == 64
    t = first_token
    assert t["oldest"] == min(t.values())
    if policy == "fcfs":  # b-long took the budget left by the oldest before the short ones came
        assert t["b-long"] <= t["d-short"]
    else:
        assert t["c-short"] < t["b-long"] and t["d-short"] < t["b-long"]


def test_shortest_prompt_admits_a_short_prompt_past_a_long_one_that_does_not_fit_the_slots():
    """With one sequence slot left behind the oldest, the short prompt that arrived later takes
    it; the long one waits and comes in after, and the pool ends free."""
    sched = make_scheduler("shortest-prompt", budget=64, max_seqs=2)
    sched.add(group("oldest", 8, 0.0, max_tokens=6))
    fake_step(sched)
    sched.add(group("long", 30, 1.0))
    sched.add(group("short", 2, 2.0))
    out, _ = fake_step(sched)
    assert {s.group.request_id for s in out.scheduled} == {"oldest", "short"}
    assert sched.waiting[0].request_id == "long" and sched.waiting[0].seqs[0].status == SequenceStatus.WAITING
    for _ in range(20):
        fake_step(sched)
    assert not sched.has_unfinished() and sched.block_manager.device.num_free == 64


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prompt"])
def test_a_short_prompt_goes_before_a_long_prompts_remaining_chunks(policy):
    """A 40-token prompt is part way through its chunks (16-token budget) when a 6-token one
    arrives. Under shortest-prompt the short prompt takes the next step's budget first and
    samples in it (shortest remaining first); under fcfs the long one's chunk goes first and
    the short one gets a partial chunk. The oldest request still runs every step, and the pool
    ends free."""
    sched = make_scheduler(policy)
    sched.add(group("oldest", 4, 0.0, max_tokens=12))
    sched.add(group("long", 40, 1.0))
    out, _ = fake_step(sched)
    assert {s.group.request_id: s.num_tokens for s in out.scheduled} == {"oldest": 4, "long": 12}
    sched.add(group("short", 6, 2.0))
    out, _ = fake_step(sched)
    chunks = [(s.group.request_id, s.num_tokens, s.samples) for s in out.scheduled if s.is_prefill]
    if policy == "fcfs":  # 15 after the oldest's decode: long to a block boundary, short the rest
        assert chunks == [("long", 12, False), ("short", 3, False)]
    else:  # short whole, then long's chunk to a block boundary (12 + 9 -> 20)
        assert chunks == [("short", 6, True), ("long", 8, False)]
    assert "oldest" in {s.group.request_id for s in out.scheduled}
    for _ in range(30):
        fake_step(sched)
    assert not sched.has_unfinished() and sched.block_manager.device.num_free == 64
