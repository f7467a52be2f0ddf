"""Scheduler on the CPU with no model: a fake step appends one token per scheduled sequence."""

from __future__ import annotations

from collections import deque

import pytest

from engine.core.config import SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.core.step import SchedulerOutput
from engine.kv.block_manager import BlockManager
from engine.sched.scheduler import Scheduler


def make_scheduler(num_blocks=64, cpu_blocks=64, block_size=4, max_seqs=8, max_tokens=64,
                   mode="swap", max_preemptions=8, prefix_caching=False, chunked=False) -> Scheduler:
    cfg = SchedulerConfig(max_seqs, max_tokens, 64, mode, max_preemptions, enable_chunked_prefill=chunked)
    return Scheduler(cfg, BlockManager(num_blocks, cpu_blocks, block_size, enable_prefix_caching=prefix_caching))


def group(rid: str, n_tokens: int, max_tokens: int = 4, t: float = 0.0, first: int = 1, **params) -> SequenceGroup:
    ids = list(range(first, first + n_tokens))
    g = SequenceGroup(rid, None, ids, SamplingParams(max_tokens=max_tokens, **params), t)
    return g


def fake_step(sched: Scheduler):
    """schedule, 'run' (mark computed, register prefilled blocks, append a token unless a partial
    prefill chunk), finish at max_tokens, free."""
    out = sched.schedule()
    return out, complete(sched, out)


def complete(sched: Scheduler, out: SchedulerOutput):
    """The rest of `fake_step` once `out` is scheduled; returns the finished requests."""
    bm = sched.block_manager
    for s in out.scheduled:
        assert s.start == bm.num_computed_tokens(s.seq)
        if not s.samples:
            assert s.is_prefill and bm.num_uncomputed_tokens(s.seq) > s.num_tokens
            continue
        assert bm.num_uncomputed_tokens(s.seq) == s.num_tokens
        s.seq.output_token_ids.append(99)
        if len(s.seq.output_token_ids) >= s.group.params.max_tokens:
            s.seq.status = SequenceStatus.FINISHED_LENGTH
    # as the engine does: computed tokens advance and full blocks join the prefix cache
    finished = sched.update_from_output(out)
    bm.check_integrity()
    return finished


def test_new_request_joins_running_batch_mid_flight():
    sched = make_scheduler()
    sched.add(group("a", 5, max_tokens=6, t=0))
    out, _ = fake_step(sched)
    assert [s.group.request_id for s in out.scheduled] == ["a"] and out.scheduled[0].is_prefill
    fake_step(sched)
    sched.add(group("b", 3, max_tokens=2, t=1))
    out, _ = fake_step(sched)
    ids = {(s.group.request_id, s.is_prefill) for s in out.scheduled}
    assert ids == {("b", True), ("a", False)}  # b prefills while a decodes, same step
    assert out.scheduled[0].group.request_id == "b"  # prefills come first in the batch


def test_finished_requests_free_their_blocks_the_same_step():
    sched = make_scheduler()
    sched.add(group("a", 5, max_tokens=2))
    fake_step(sched)
    assert sched.block_manager.num_free_device_blocks < 64
    _, finished = fake_step(sched)
    assert [g.request_id for g in finished] == ["a"]
    assert sched.block_manager.all_free()
    assert not sched.has_unfinished()


def test_budgets_hold():
    sched = make_scheduler(max_seqs=3, max_tokens=20)
    for i in range(6):
        sched.add(group(f"r{i}", 8, max_tokens=3, t=i))
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        assert len(out.scheduled) <= 3
        assert out.num_batched_tokens <= 20
        assert len(sched.running) <= 3


def test_first_come_first_served_admission():
    sched = make_scheduler(max_seqs=1)
    for i in range(3):
        sched.add(group(f"r{i}", 4, max_tokens=2, t=i))
    order = []
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        order += [s.group.request_id for s in out.scheduled if s.is_prefill]
    assert order == ["r0", "r1", "r2"]


def test_preemption_swaps_newest_and_brings_it_back_first():
    # 6 blocks of 4 tokens; two requests of 8 tokens growing to 16 cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, max_tokens=64)
    sched.add(group("old", 8, max_tokens=8, t=0))
    sched.add(group("new", 8, max_tokens=8, t=1))
    preempted = []
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        preempted += out.preempted
        if out.blocks_to_swap_in:
            assert sched.running[-1].request_id == "new"
    assert preempted and set(preempted) == {"new"}
    assert sched.num_preemptions["swap"] >= 1
    assert sched.block_manager.all_free()


def test_recompute_preemption_requeues_at_front():
    sched = make_scheduler(num_blocks=6, block_size=4, mode="recompute")
    sched.add(group("old", 8, max_tokens=8, t=0))
    sched.add(group("new", 8, max_tokens=8, t=1))
    sched.add(group("later", 2, max_tokens=1, t=2))
    seen_recompute = False
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        if out.preempted:
            seen_recompute = True
            assert sched.waiting[0].request_id == "new"  # ahead of "later"
            assert sched.block_manager.num_computed_tokens(sched.waiting[0].seqs[0]) == 0
    assert seen_recompute and sched.num_preemptions["recompute"] >= 1
    assert sched.block_manager.all_free()


def test_abort_frees_blocks_in_any_queue():
    sched = make_scheduler()
    sched.add(group("a", 5, max_tokens=10))
    sched.add(group("b", 5, max_tokens=10))
    fake_step(sched)
    sched.add(group("c", 5))
    for rid in ("a", "c", "b"):
        assert sched.abort(rid) is not None
    assert sched.abort("unknown") is None
    assert sched.block_manager.all_free()
    assert not sched.has_unfinished()


def run_to_completion(sched: Scheduler) -> None:
    steps = 0
    while sched.has_unfinished():
        fake_step(sched)
        steps += 1
        assert steps < 2000, "the workload never finished"


def test_oldest_request_is_never_preempted_and_all_finish():
    """No starvation by age: victims are always newer than the request that needs a block, so
    the oldest unfinished request is never preempted and every request becomes the oldest."""
    sched = make_scheduler(num_blocks=16, block_size=4, mode="recompute")
    groups = [group(f"r{i}", 2, max_tokens=24, t=i) for i in range(8)]
    for g in groups:
        sched.add(g)
    steps = 0
    while sched.has_unfinished():
        oldest = min((g for g in groups if not g.is_finished), key=lambda g: g.arrival_time)
        out, _ = fake_step(sched)
        assert oldest.request_id not in out.preempted
        steps += 1
        assert steps < 2000
    assert sum(g.num_preemptions for g in groups) > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_bound_moves_preemptions_to_others(mode):
    """With the bound, a request that had its share is skipped while another candidate exists."""
    counts = {}
    for limit in (100, 2):
        sched = make_scheduler(num_blocks=16, block_size=4, mode=mode, max_preemptions=limit)
        groups = [group(f"r{i}", 2, max_tokens=24, t=i) for i in range(8)]
        for g in groups:
            sched.add(g)
        run_to_completion(sched)
        counts[limit] = [g.num_preemptions for g in groups]
        assert sched.block_manager.all_free()
    assert max(counts[100]) > 2  # newest-first alone preempts one request three times
    assert max(counts[2]) <= 2


@pytest.mark.parametrize("prompt_logprobs", [None, 0])
def test_admission_charges_the_token_budget_only_for_uncached_tokens(prompt_logprobs):
    """Budget 32 tokens. After a 16-token prompt, a 28-token prompt whose first 24 tokens are
    cached costs 4, so a 12-token prompt joins them in the same step. A prompt-logprob request
    computes its whole prompt, so it is charged all 28 and waits with the one behind it."""
    sched = make_scheduler(block_size=4, max_tokens=32, prefix_caching=True)
    sched.add(group("warm", 24, max_tokens=1, t=0))
    out, finished = fake_step(sched)
    assert [g.request_id for g in finished] == ["warm"]  # its 6 full prompt blocks stay cached
    sched.add(group("x", 16, max_tokens=1, t=1, first=500))
    sched.add(group("long", 28, max_tokens=1, t=2, prompt_logprobs=prompt_logprobs))
    sched.add(group("y", 12, max_tokens=1, t=3, first=600))
    assert sched.block_manager.num_tokens_to_compute(sched.waiting[1]) == (4 if prompt_logprobs is None else 28)
    out, _ = fake_step(sched)
    got = [(s.group.request_id, s.num_tokens) for s in out.scheduled]
    if prompt_logprobs is None:
        assert got == [("x", 16), ("long", 4), ("y", 12)]
        assert out.num_batched_tokens == 32
        assert sched.waiting == deque()
    else:
        assert got == [("x", 16)]  # 16 + 28 > 32
        assert [g.request_id for g in sched.waiting] == ["long", "y"]
    run_to_completion(sched)
    assert sched.block_manager.num_free_device_blocks == 64


def test_admission_of_a_cached_prompt_shares_live_blocks():
    """A prompt whose full blocks are in use by a running request takes only its tail from the
    free pool: with 1 block free, a second copy of a running 9-token prompt is admitted and
    computes 1 token; before, it waited for 3 free blocks."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_tokens=64, prefix_caching=True)
    sched.add(group("a", 9, max_tokens=3, t=0))  # blocks 0, 1 (full), 2
    fake_step(sched)
    sched.add(group("b", 9, max_tokens=3, t=1))
    out, _ = fake_step(sched)
    got = [(s.group.request_id, s.num_tokens, s.block_table.tolist()) for s in out.scheduled]
    assert got == [("b", 1, [0, 1, 3]), ("a", 1, [0, 1, 2])]
    assert sched.block_manager.num_free_device_blocks == 0


# ---------------------------------------------------------------- chunked prefill


def chunks_of(out, rid: str) -> list[tuple[int, bool]]:
    return [(s.num_tokens, s.samples) for s in out.scheduled if s.group.request_id == rid]


@pytest.mark.parametrize("block_size, chunks", [(1, [31, 31, 8]), (4, [28, 28, 14])])
def test_chunked_prefill_splits_a_long_prompt_around_running_decodes(block_size, chunks):
    """Budget 32 and one running decode: a 70-token prompt is prefilled in chunks of what is left
    (cut back to a block boundary), the decode runs in every step, and only the last chunk samples."""
    sched = make_scheduler(num_blocks=128, block_size=block_size, max_tokens=32, chunked=True)
    sched.add(group("a", 5, max_tokens=10, t=0))
    fake_step(sched)
    long = group("b", 70, max_tokens=2, t=1, first=100)
    sched.add(long)
    seen = []
    for _ in range(len(chunks)):
        out, _ = fake_step(sched)
        assert chunks_of(out, "a") == [(1, True)]  # the decode keeps its pace
        assert out.num_batched_tokens == 1 + chunks_of(out, "b")[0][0] <= 32
        assert out.scheduled[0].group.request_id == "b" and out.scheduled[0].is_prefill
        seen += chunks_of(out, "b")
        assert long.seqs[0].status == SequenceStatus.RUNNING
        # every prompt block was allocated at admission and stays allocated between chunks
        assert len(sched.block_manager.block_table(long.seqs[0])) == -(-70 // block_size)
    assert seen == [(n, i == len(chunks) - 1) for i, n in enumerate(chunks)]
    assert long.seqs[0].output_token_ids == [99]
    out, _ = fake_step(sched)
    assert chunks_of(out, "b") == [(1, True)]  # now it decodes
    run_to_completion(sched)
    assert sched.block_manager.all_free()


def test_chunked_prefill_off_waits_for_the_whole_budget():
    sched = make_scheduler(block_size=4, max_tokens=32)
    sched.add(group("a", 5, max_tokens=10, t=0))
    fake_step(sched)
    sched.add(group("b", 32, max_tokens=1, t=1, first=100))
    for _ in range(9):  # 31 tokens left each step while "a" decodes
        out, _ = fake_step(sched)
        assert chunks_of(out, "b") == []
    out, _ = fake_step(sched)  # "a" has finished
    assert chunks_of(out, "b") == [(32, True)]


def test_chunked_prefill_chunks_prompt_logprob_requests_like_any_other():
    """Prompt logprobs are scored chunk by chunk (engine/sample/prompt_logprobs.py): such a request's
    prompt takes what is left of the budget beside the decodes, as any prompt does."""
    sched = make_scheduler(block_size=4, max_tokens=32, chunked=True)
    sched.add(group("a", 5, max_tokens=3, t=0))
    fake_step(sched)
    sched.add(group("p", 32, max_tokens=1, t=1, first=100, prompt_logprobs=1))
    out, _ = fake_step(sched)
    assert chunks_of(out, "p") == [(28, False)]
    assert out.num_batched_tokens <= 32
    out, _ = fake_step(sched)
    assert chunks_of(out, "p") == [(4, True)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_partial_prefill_goes_on_prefilling(mode):
    """A request preempted between its chunks: swapped, it comes back with its computed tokens and
    goes on prefilling from there; recomputed, it starts again from its first token."""
    # 23 blocks of 4 tokens. "old" (16 tokens, 4 blocks) decodes; "long" (76 tokens, 19 blocks)
    # takes every other block at admission, so old's next block forces out the newest: "long".
    sched = make_scheduler(num_blocks=23, block_size=4, max_tokens=16, mode=mode, chunked=True)
    old = group("old", 15, max_tokens=10, t=0)
    sched.add(old)
    fake_step(sched)  # old: 16 tokens
    long = group("long", 76, max_tokens=2, t=1, first=100)
    sched.add(long)
    out, _ = fake_step(sched)  # old: 17 tokens; long: chunk [0, 12) of a 15-token budget
    assert chunks_of(out, "long") == [(12, False)]
    out, _ = fake_step(sched)  # old needs a 5th block: none free
    assert out.preempted == ["long"] and chunks_of(out, "long") == []
    seq, bm = long.seqs[0], sched.block_manager
    assert bm.num_computed_tokens(seq) == (12 if mode == "swap" else 0) and not seq.output_token_ids
    assert seq.status == (SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING)
    starts = []
    while not seq.output_token_ids:
        before = bm.num_computed_tokens(seq)
        out, _ = fake_step(sched)
        for n, _ in chunks_of(out, "long"):
            starts.append((before, n))
            assert out.scheduled[0].is_prefill
    assert starts[0][0] == (12 if mode == "swap" else 0) and sum(n for _, n in starts) == 76 - starts[0][0]
    run_to_completion(sched)
    assert sched.block_manager.all_free()


@pytest.mark.parametrize("prompt_len, steps", [
    # 7 shared full prompt blocks (28 tokens): the second sample starts at 28 and joins in the
    # step in which the first computes them
    (30, [[(0, 0, 16, False)], [(0, 16, 15, True), (1, 28, 1, False)], [(1, 29, 2, True), (0, 31, 1, True)]]),
    # only its last token to compute: it decodes in the step in which the first computes the
    # shared blocks
    (28, [[(0, 0, 16, False)], [(0, 16, 13, True), (1, 28, 1, True)], [(0, 29, 1, True), (1, 29, 1, True)]]),
])
def test_recomputed_samples_wait_for_the_shared_prompt_blocks(prompt_len, steps):
    """Two samples of one request recomputed in chunks (budget 16) share the first one's prompt
    blocks: the second computes nothing past them before the first has computed them (in the
    same step at the latest: every layer writes the step's K/V before attending)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_tokens=16, mode="recompute", chunked=True)
    g = group("n2", prompt_len, max_tokens=8, t=0)
    sched.add(g)
    while not g.seqs[0].output_token_ids:
        fake_step(sched)
    bm = sched.block_manager
    child = g.seqs[0].fork(1, None)
    bm.fork(g.seqs[0], child)
    g.seqs.append(child)
    child.output_token_ids[-1] = 98  # the samples differ
    sched._preempt(g, SchedulerOutput())
    sched.running.remove(g)
    seen = []
    for _ in range(3):
        before = {s.seq_id: bm.num_computed_tokens(s) for s in g.seqs}
        out, _ = fake_step(sched)
        seen.append([(s.seq.index, before[s.seq.seq_id], s.num_tokens, s.samples) for s in out.scheduled])
    assert seen == steps
    run_to_completion(sched)
    assert bm.all_free()
