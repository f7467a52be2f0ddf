"""Continuous batching over waiting / running / swapped queues, with liveness by construction.

A request's priority (`SequenceGroup.priority`: arrival time, then creation order) decides who is
the oldest, who is preempted and whose decodes go first; the scheduling policy decides the order
in which waiting requests come in (engine/sched/admission_order.py). A request's *lead* is its
lowest-index unfinished sequence (all the beams of a beam search, which run together); the
other samples of n / best_of are its *extras*. Blocks, sequence slots and the token budget go to
leads first, oldest first; extras get what is left.
Each step:
(0) The oldest request's lead runs. If it is swapped out, waiting, or parked, room is made (extras
    anywhere are parked, then newer requests preempted, newest first) and it is brought in.
(1) Every running sequence gets a slot for its next token and at most max_num_seqs run: extras
    are parked (freed, to be recomputed; the newest request's highest-index one first), then
    the newest requests preempted, never the oldest (`_fit_running`). The oldest request's
    sequences are scheduled first, in index order, with the whole token budget; then every other
    decode within what is left (a decode that does not fit waits a step and keeps its blocks);
    then the chunks of partially prefilled requests (chunked prefill), oldest first (under
    shortest-prompt, a chunk with more tokens left than the shortest fresh prompt goes after (2)).
(2) If no request was preempted: leads that are out (swapped, waiting, parked) come in, in the
    order of the scheduling policy (engine/sched/admission_order.py: oldest first, or shortest fresh
    prompt first), parking extras to make room, stopping at the first that does not fit. A
    waiting prompt is charged for the tokens it computes, not those the prefix cache serves.
(3) If nothing was preempted or parked: parked extras come back, oldest request first, when
    they leave a block of room per running sequence (so that they are not parked again at once).

Why this is live, and why one request can only hurt itself (the policy the hardening issue asked
for, tested in tests/engine/test_liveness.py):
- Every request fits the pool on its own: one sequence holds at most max_model_len tokens, which
  the pool holds (checked at start-up); the engine refuses at admission (400) a beam search whose
  beams could outgrow the pool together (width x blocks of prompt + max_tokens), and best_of or a
  beam width above max_num_seqs. Samples of n / best_of need not run together, so a request whose
  samples outgrow the pool runs them a few at a time.
- A request is swapped out only if it could come back into the whole pool
  (`BlockManager.fits_pool_after_swap`); otherwise it is recomputed.
- The oldest request's lead is never parked or preempted, (0) brings it in and (1) runs it first,
  so it advances every step (max_num_batched_tokens >= max_num_seqs: its decodes fit). It finishes
  within `pre + M` steps (M: max_tokens after the context cap; pre: its prefill, 1 step without
  chunking, at most P + M with it), then the next sample becomes the lead. So a request finishes
  within W = s * (pre + M) steps of becoming the oldest (s: best_of; beams advance together), and
  the k-th request by arrival by step max(arrival_k, finish_{k-1}) + W_k: no starvation.
- Extras never take blocks, slots or budget from another request's lead: a request with many
  samples cannot preempt, delay or block anyone else; its extra samples only use spare room.
- Whole requests are preempted newest first, skipping those preempted `max_preemptions_per_request`
  times if any other can go.

With `preemption_mode="swap"` a preempted request's blocks move to the CPU swap pool; when that
pool is full, the request could not come back, or in "recompute" mode, they are freed and it is
prefilled again later from its prompt and generated tokens. A parked extra is always recomputed.

Chunked prefill (`enable_chunked_prefill`): a prompt whose uncomputed tokens exceed the step's
remaining budget is prefilled over several steps, each chunk ending on a block boundary where the
budget allows (`StepPlan._chunk_size`); it samples only at the chunk that computes its last token
(`ScheduledSeq.samples`). A request with prompt logprobs is chunked like any other: each chunk
scores its own rows and the scores gather on the request (engine/sample/prompt_logprobs.py), so no
step runs more than the budget. Recomputed beams prefill up to their last token, then decode
together, so that every beam samples in the same step.

Step-time target (`target_itl_ms`): other requests' chunks are cut so that a step with decodes
stays within a time, unless they have waited long (engine/sched/step_cost.py says how and why).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from engine.core.config import SchedulerConfig
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.step import ScheduledSeq, SchedulerOutput
from engine.kv.block_manager import AdmissionPlan, AllocStatus, BlockManager
from engine.kv.kv_view import KvEventLog
from engine.sched.admission_order import admission_queue, chunks_after
from engine.sched.step_cost import StepCost
from engine.sched.step_plan import PrefillCap, StepPlan, all_at_once, has_waiting

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock=time.monotonic):
        self.config = config
        self.block_manager = block_manager
        self.clock = clock  # the requests' arrival_time clock (the step-time target's waits)
        # the engine feeds it each step's time (`LLMEngine.step`); None: no step-time target
        self.step_cost: StepCost | None = PrefillCap.cost_for(config)
        self.waiting: deque[SequenceGroup] = deque()  # by priority
        self.running: list[SequenceGroup] = []  # by priority (oldest first)
        self.swapped: deque[SequenceGroup] = deque()  # by priority
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.swapped_blocks = {"in": 0, "out": 0}  # cumulative block counts
        self.dropped: list[SequenceGroup] = []  # failed by the scheduler, not yet reported by the engine
        self.events = KvEventLog()  # copy-on-writes and preemptions, for the dashboard

    # ---------------------------------------------------------------- queue ops
    def add(self, group: SequenceGroup) -> None:
        _insert(self.waiting, group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove the request from whichever queue holds it, free its blocks; None if unknown."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    group.set_status(SequenceStatus.FINISHED_ABORTED)
                    self._free(group)
                    return group
        return None

    def _free(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.block_manager.free(seq)

    def update_from_output(self, out: SchedulerOutput, forks: Iterable[tuple[Sequence, Sequence]] = (),
                           dropped: Iterable[Sequence] = ()) -> list[SequenceGroup]:
        """The step's bookkeeping once the model has run `out` and the engine has applied its
        samples: every scheduled sequence's computed tokens advance and its newly full blocks
        join the prefix cache; `forks` (parent, child: new samples, new beams) share their
        parent's blocks; `dropped` beams and finished sequences free theirs. Returns the
        requests that finished (they leave `running`). The only post-step caller of the block
        manager."""
        bm = self.block_manager
        bm.mark_all_computed(out.scheduled)
        for parent, child in forks:
            bm.fork(parent, child)
        for seq in dropped:
            bm.free(seq)
        return self.free_finished()

    def free_finished(self) -> list[SequenceGroup]:
        """Free the blocks of finished sequences and drop finished requests from `running`
        (`update_from_output` does it after each step). Returns the finished."""
        done, kept, free = [], [], self.block_manager.free
        for group in self.running:
            unfinished = False  # NOTE: group.is_finished, found in the same pass (every request, every step)
            for seq in group.seqs:
                if seq.status > _SWAPPED:  # finished
                    free(seq)
                else:
                    unfinished = True
            (kept if unfinished else done).append(group)
        if done:
            self.running[:] = kept
        return done

    def reset(self) -> None:
        """A fresh KV pool and empty preemption, swap and event totals: after the start-up
        calibration's requests (engine/loop/step_calibration.py), with no request left."""
        self.block_manager.reset()
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.swapped_blocks = {"in": 0, "out": 0}
        self.events = KvEventLog()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def oldest(self) -> SequenceGroup | None:
        """The unfinished request served first (the liveness argument's 'oldest')."""
        heads = [q[0] for q in (self.waiting, self.swapped) if q] + self.running[:1]
        return min(heads, key=lambda g: g.priority, default=None)

    # ---------------------------------------------------------------- leads and extras
    @staticmethod
    def _lead(group: SequenceGroup) -> list[Sequence]:
        """The sequences that run with the request's priority: its beams, or its lowest-index
        unfinished sample."""
        unfinished = group.unfinished_seqs
        return unfinished if group.is_beam_search else unfinished[:1]

    def _lead_running(self, group: SequenceGroup) -> bool:
        seqs = group.seqs
        if len(seqs) == 1:  # NOTE: the common case, at every step for every request
            return seqs[0].status == _RUNNING
        return all(s.status == _RUNNING for s in self._lead(group))

    def _running_seqs(self) -> list[Sequence]:
        return [s for g in self.running for s in g.seqs if s.status == _RUNNING]

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        step = StepPlan(SchedulerOutput(), self.config.max_num_batched_tokens, self.block_manager,
                        self.block_manager.append_slot, self.config.enable_chunked_prefill, PrefillCap.of(self))
        oldest = self.oldest()
        if oldest is not None and not self._lead_running(oldest) and not self._bring_in(oldest, step, preempt=True):
            logger.error("the oldest request %s cannot be brought in (not expected)", oldest.request_id)
        lead_preempted, num_running = self._fit_running(step, oldest)

        # (1) The oldest request first (all its sequences), then every decode, then chunks
        # (NOTE: none when every running sequence already has its slot, the common decode step).
        for group in self.running:
            step.schedule_group(group, decode=True, prefill=group is oldest, oldest=group is oldest)
        # `parked`: the running requests with a waiting sequence (a parked lead or extra), looked
        # up again if (2) brings any in. NOTE: a whole request preempted means (2) and (3) do not run.
        parked, queue = [], []
        if not lead_preempted:
            parked = [g for g in self.running if has_waiting(g)]
            parked_leads = [g for g in parked if not self._lead_running(g)]
            queue = admission_queue(self.config.scheduling_policy, self.config.max_num_seqs, self.swapped,
                                    self.waiting, parked_leads)
        deferred = []
        if len(step.scheduled) < num_running and step.tokens >= 1:
            deferred = step.schedule_chunks(self.running, oldest, chunks_after(self.config.scheduling_policy, queue))

        # (2) Leads that are out come in (admission_order.py), then the chunks deferred behind them.
        for group in queue:
            if not self._bring_in(group, step, preempt=False):
                break
        if deferred:
            step.schedule_chunks(deferred, oldest)
        if queue:
            parked = [g for g in self.running if has_waiting(g)]

        # (3) Parked extras come back into spare room.
        if not step.out.preempted:
            for group in parked:
                if not self._admit(group, group.seqs_with_status(_WAITING), step, spare=True):
                    break
        out = step.out
        out.scheduled = step.prefills + step.decodes
        if out.blocks_to_copy:
            for s, cow in step.scheduled.values():
                for src, dst in cow or ():
                    if dst in s.block_table:  # (group 0's copy: the table the dashboard shows)
                        self.events.record("cow", s.group.request_id, seq_index=s.seq.index, src=src, dst=dst,
                                           logical_block=s.block_table.index(dst))
        out.num_batched_tokens = self.config.max_num_batched_tokens - step.tokens
        out.table_rows = self.block_manager.rows
        out.table_changes = self.block_manager.take_table_changes()
        return out

    # ---------------------------------------------------------------- making room
    def _fit_running(self, step: StepPlan, oldest: SequenceGroup | None) -> tuple[bool, int]:
        """Park extras, then preempt the newest requests, until every running sequence can get a
        slot for its next token and at most max_num_seqs run. Returns whether a request was
        preempted whole, and how many sequences run."""
        bm = self.block_manager
        preempted = False
        while True:
            seqs = self._running_seqs()
            # NOTE: a sequence's next slot takes at most one free block per layer group (a new
            # last block, or a copy of a shared one), so with that many free no count is needed.
            if len(seqs) <= self.config.max_num_seqs and (
                    len(seqs) * bm.num_groups <= bm.num_free_device_blocks
                    or bm.num_append_blocks(seqs) <= bm.num_free_device_blocks):
                return preempted, len(seqs)
            if self._park_lowest_extra(step):
                continue
            victim = self._pick_victim([g for g in self.running if g is not oldest])
            if victim is None:
                logger.error("the oldest request %s does not fit on its own (not expected)", oldest.request_id)
                return preempted, len(seqs)
            self.running.remove(victim)
            self._preempt(victim, step.out)
            preempted = True

    def _pick_victim(self, candidates: list[SequenceGroup]) -> SequenceGroup | None:
        """The latest arrival among `candidates`, skipping requests already preempted
        `max_preemptions_per_request` times if possible."""
        pool = sorted(candidates, key=lambda g: g.priority)
        fresh = [g for g in pool if g.num_preemptions < self.config.max_preemptions_per_request]
        return (fresh or pool)[-1] if pool else None

    def _park_lowest_extra(self, step: StepPlan) -> bool:
        """Park the running extra with the lowest priority (the newest request's highest-index
        one; no sibling waits for its blocks, see `_caught_up`), taking back what this step had
        scheduled for it. False if no extra runs."""
        for group in reversed(self.running):
            if group.is_beam_search:
                continue
            lead = self._lead(group)
            extras = [s for s in group.seqs if s.status == _RUNNING and s not in lead]
            if extras:
                self._park(group, extras[-1], step)
                return True
        return False

    def _park(self, group: SequenceGroup, seq: Sequence, step: StepPlan) -> None:
        step.unschedule(seq)
        self.block_manager.free_to_recompute(seq)
        seq.status = _WAITING
        self._count_preemption(group, step.out, "recompute", f"parked sample {seq.index} of")
        self.events.record("park", group.request_id, seq_index=seq.index)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(group) and bm.fits_pool_after_swap(group):
            mapping = bm.swap_out(group)
            out.blocks_to_swap_out.extend(mapping)
            self.swapped_blocks["out"] += len(mapping)
            for seq in group.seqs_with_status(_RUNNING):
                seq.status = _SWAPPED
            _insert(self.swapped, group)
            mode = "swap"
            self.events.record("swap_out", group.request_id, num_blocks=len(mapping))
        else:
            for seq in group.unfinished_seqs:
                bm.free_to_recompute(seq)
                seq.status = _WAITING
            _insert(self.waiting, group)
            mode = "recompute"
            self.events.record("recompute", group.request_id)
        self._count_preemption(group, out, mode, "preempted")

    def _count_preemption(self, group: SequenceGroup, out: SchedulerOutput, mode: str, what: str) -> None:
        group.num_preemptions += 1
        group.metrics.num_preemptions += 1
        out.preempted.append(group.request_id)
        self.num_preemptions[mode] += 1
        logger.warning("%s request %s by %s (blocks ran out); %d preemptions so far", what, group.request_id,
                       mode, sum(self.num_preemptions.values()))

    # ---------------------------------------------------------------- bringing leads in
    def _bring_in(self, group: SequenceGroup, step: StepPlan, *, preempt: bool) -> bool:
        """Swap in or admit the request's lead (with as many other samples as fit as they are),
        parking extras for room, and with `preempt` (the oldest, before anything is scheduled)
        preempting newer requests too. Scheduled at once unless `preempt`. False if it does
        not fit now."""
        bm = self.block_manager
        swapped = group in self.swapped
        if swapped:
            seqs = needed = group.seqs_with_status(_SWAPPED)
        else:
            seqs = group.seqs_with_status(_WAITING)
            needed = seqs if all_at_once(group) else seqs[:1]
        slots = max(len(needed), group.params.best_of if group.is_beam_search else 0)

        def fits() -> bool:
            if len(self._running_seqs()) + slots > self.config.max_num_seqs:
                return False
            if swapped:  # each swapped sequence decodes a token (or computes a chunk) at once
                return bm.can_swap_in(group) and (preempt or step.tokens >= len(needed))
            fits_pool = bm.plan(group, needed).status is AllocStatus.OK
            return fits_pool and (preempt or step.prefill_fits(group, needed))

        while not fits():
            if self._park_lowest_extra(step):
                continue
            victim = self._pick_victim([g for g in self.running if g.priority > group.priority]) if preempt else None
            if victim is None:
                if group in self.waiting and bm.plan(group, needed).status is AllocStatus.NEVER:
                    self._drop(group, "The request needs more KV blocks than the whole cache holds.")
                return False
            self.running.remove(victim)
            self._preempt(victim, step.out)
        if swapped:
            self.swapped.remove(group)
            self._swap_in(group, step)
        else:
            self._allocate(group, self._largest_fitting(group, seqs, len(needed), step, preempt), preempt)
        if group not in self.running:
            if group in self.waiting:
                self.waiting.remove(group)
            _insert(self.running, group)
        if not preempt:
            step.schedule_group(group, decode=True, prefill=True)
        return True

    def _largest_fitting(self, group: SequenceGroup, seqs: list[Sequence], least: int, step: StepPlan,
                         ignore_budget: bool) -> AdmissionPlan:
        """The plan for the longest prefix of `seqs` (at least `least`, which fits) that fits the
        pool, the sequence slots and the token budget as they are."""
        bm = self.block_manager
        room = self.config.max_num_seqs - len(self._running_seqs())
        for j in range(min(len(seqs), max(room, least)), least, -1):
            plan = bm.plan(group, seqs[:j])
            if plan.status is AllocStatus.OK and (ignore_budget or step.prefill_fits(group, plan)):
                return plan
        return bm.plan(group, seqs[:least])

    def _admit(self, group: SequenceGroup, seqs: list[Sequence], step: StepPlan, spare: bool) -> bool:
        """Admit as many of the parked `seqs` as fit, leaving (`spare`) a free block per running
        sequence and layer group; schedules their prefills. False if none fit."""
        bm = self.block_manager
        running = len(self._running_seqs())
        for j in range(min(len(seqs), self.config.max_num_seqs - running), 0, -1):
            plan = bm.plan(group, seqs[:j], reserve=(running + j) * bm.num_groups if spare else 0)
            if plan.status is AllocStatus.OK and step.prefill_fits(group, plan):
                self._allocate(group, plan, schedule_later=False)
                step.schedule_group(group, decode=True, prefill=True, only=plan.seqs)
                return True
        return False

    def _allocate(self, group: SequenceGroup, plan: AdmissionPlan, schedule_later: bool) -> None:
        """Carry out the admission `plan` (status OK); its sequences become RUNNING."""
        first_admission = group.metrics.first_scheduled_time is None
        # NOTE: blocks whose tokens this step might not compute (a chunk, a recomputed beam that
        # stops short of its last token, anything scheduled after (1)) publish no prefix-cache
        # hash yet; the engine registers each block once its tokens have run.
        chunks = self.config.enable_chunked_prefill
        register = not schedule_later and not chunks and not StepPlan.is_multi_beam(group)
        self.block_manager.allocate(group, register=register, plan=plan)
        for seq in plan.seqs:
            if first_admission:
                group.num_cached_tokens = self.block_manager.num_computed_tokens(seq)
            seq.status = _RUNNING

    def _swap_in(self, group: SequenceGroup, step: StepPlan) -> None:
        mapping = self.block_manager.swap_in(group)
        step.out.blocks_to_swap_in.extend(mapping)
        self.swapped_blocks["in"] += len(mapping)
        self.events.record("swap_in", group.request_id, num_blocks=len(mapping))
        for seq in group.seqs_with_status(_SWAPPED):
            seq.status = _RUNNING

    def _drop(self, group: SequenceGroup, message: str) -> None:
        """Fail a request that can never run (the engine refuses such requests up front; this
        guards against a pool that shrank under one). The engine reports it from `dropped`."""
        logger.error("request %s can never run: %s", group.request_id, message)
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._free(group)
        group.error, group.invalid_request = message, True
        group.set_status(SequenceStatus.FINISHED_ABORTED)
        self.dropped.append(group)


def _insert(queue, group: SequenceGroup) -> None:
    """Put `group` in a queue kept in priority order (at the end when it is the newest)."""
    if not queue or queue[-1].priority <= group.priority:
        queue.append(group)
        return
    i = next(i for i, g in enumerate(queue) if g.priority > group.priority)
    queue.insert(i, group)

