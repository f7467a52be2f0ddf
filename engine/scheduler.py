"""Continuous batching over waiting / running / swapped queues.

Each step: (1) every running request gets a slot for its next token, preempting the newest
running requests when blocks run out; (2) if nothing was preempted, swapped requests come back,
oldest first; (3) if nothing is still swapped out, waiting requests are admitted first come,
first served, within the sequence and token budgets (a prompt is charged for the tokens it
computes this step, not for those the prefix cache serves). Requests join and leave at every step.

Preemption policy (victim in `_pick_victim`, mode in `_preempt`): when a running request needs a
block and none is free, the victim is the latest-arriving request among those not yet given a
slot this step (the needy one included) that has been preempted fewer than
`max_preemptions_per_request` times, or the latest of them all if every one has. Victims are
never older than the request that needs the block, so the oldest unfinished request is never
preempted (the pool always holds one max_model_len request): every request eventually becomes
the oldest and finishes, which is the no-starvation guarantee; the per-request bound spreads
preemptions over newer requests before one is preempted again. With
`preemption_mode="swap"` its blocks move to the CPU swap pool; when that pool is full (or in
"recompute" mode) its blocks are freed and it re-enters the waiting queue to be prefilled again
from its prompt and the tokens it had generated.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import AllocStatus, BlockManager
from engine.config import SchedulerConfig
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence  # the sequence to run
    group: SequenceGroup  # its request
    num_tokens: int  # tokens computed for it this step (its uncomputed tail; 1 when decoding)
    is_prefill: bool  # True when this step computes more than the last token
    block_table: list[int] = field(default_factory=list)  # physical block ids, filled at the end of schedule()


@dataclass
class SchedulerOutput:
    """What one step runs. The model runner carries it out; nothing here is a tensor."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # prefills first, then decodes
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[str] = field(default_factory=list)  # request ids preempted this step
    num_batched_tokens: int = 0  # sum of num_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # oldest first
        self.swapped: deque[SequenceGroup] = deque()  # oldest first
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.swapped_blocks = {"in": 0, "out": 0}  # cumulative block counts

    # ---------------------------------------------------------------- queue ops
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove the request from whichever queue holds it, free its blocks; None if unknown."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs:
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self._free(group)
                    return group
        return None

    def _free(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.block_manager.free(seq)

    def free_finished(self) -> list[SequenceGroup]:
        """Free the blocks of finished sequences and drop finished requests from `running`;
        called by the engine after it has applied the step's samples. Returns the finished."""
        done = []
        for group in list(self.running):
            for seq in group.seqs:
                if seq.status.is_finished:
                    self.block_manager.free(seq)
            if group.is_finished:
                self.running.remove(group)
                done.append(group)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget_seqs = self.config.max_num_seqs
        budget_tokens = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []

        # (1) Running requests: a slot for each sequence's next token, preempting when needed.
        kept: list[SequenceGroup] = []
        queue = list(self.running)  # oldest first; victims are taken from the end
        while queue:
            group = queue.pop(0)
            while not self.block_manager.can_append_slots(group):
                victim = self._pick_victim(queue, group)
                if victim is group:
                    self._preempt(group, out)
                    break
                queue.remove(victim)
                self._preempt(victim, out)
            else:
                for seq in group.seqs_with_status(SequenceStatus.RUNNING):
                    cow = self.block_manager.append_slot(seq)
                    if cow is not None:
                        out.blocks_to_copy.append(cow)
                    decodes.append(ScheduledSeq(seq, group, seq.num_uncomputed_tokens, False))
                kept.append(group)
        self.running = kept
        budget_seqs -= sum(len(g.seqs_with_status(SequenceStatus.RUNNING)) for g in kept)
        budget_tokens -= sum(s.num_tokens for s in decodes)

        # (2) Swapped requests come back before any new request, oldest first.
        if not out.preempted:
            while self.swapped:
                group = self.swapped[0]
                n = len(group.seqs_with_status(SequenceStatus.SWAPPED))
                if n > budget_seqs or n > budget_tokens or not self.block_manager.can_swap_in(group):
                    break
                self.swapped.popleft()
                mapping = self.block_manager.swap_in(group)
                out.blocks_to_swap_in.extend(mapping)
                self.swapped_blocks["in"] += len(mapping)
                group.set_status(SequenceStatus.RUNNING)
                for seq in group.seqs_with_status(SequenceStatus.RUNNING):
                    cow = self.block_manager.append_slot(seq)
                    if cow is not None:
                        out.blocks_to_copy.append(cow)
                    decodes.append(ScheduledSeq(seq, group, seq.num_uncomputed_tokens, False))
                self.running.append(group)
                budget_seqs -= n
                budget_tokens -= n

        # (3) Waiting requests, first come first served.
        prefills: list[ScheduledSeq] = []
        if not out.preempted and not self.swapped:
            while self.waiting:
                group = self.waiting[0]
                seqs = group.seqs_with_status(SequenceStatus.WAITING)
                # NOTE: the token budget is charged for what this step computes: a prompt's
                # prefix-cache hits cost nothing.
                num_tokens = self.block_manager.num_tokens_to_compute(group)
                if len(seqs) > budget_seqs or num_tokens > budget_tokens:
                    break
                status = self.block_manager.can_allocate(group)
                if status is AllocStatus.LATER:
                    break
                if status is AllocStatus.NEVER:
                    # The engine rejects such prompts up front; this guards against a pool
                    # that shrank under a request (never expected).
                    logger.error("request %s can never fit in the KV pool; aborting it", group.request_id)
                    self.waiting.popleft()
                    group.set_status(SequenceStatus.FINISHED_ABORTED)
                    continue
                self.waiting.popleft()
                self.block_manager.allocate(group)
                first_admission = group.metrics.first_scheduled_time is None
                for seq in seqs:
                    if first_admission:
                        group.num_cached_tokens = seq.num_computed_tokens
                    seq.status = SequenceStatus.RUNNING
                    prefills.append(ScheduledSeq(seq, group, seq.num_uncomputed_tokens, True))
                self.running.append(group)
                budget_seqs -= len(seqs)
                budget_tokens -= sum(s.num_uncomputed_tokens for s in seqs)
        self.running.sort(key=lambda g: g.arrival_time)
        out.scheduled = prefills + decodes
        for s in out.scheduled:
            s.block_table = self.block_manager.block_table(s.seq)
        out.num_batched_tokens = sum(s.num_tokens for s in out.scheduled)
        return out

    def _pick_victim(self, queue: list[SequenceGroup], current: SequenceGroup) -> SequenceGroup:
        """The latest arrival among the not-yet-scheduled running requests (and `current`),
        skipping requests already preempted `max_preemptions_per_request` times if possible."""
        candidates = queue + [current]
        candidates.sort(key=lambda g: g.arrival_time)
        limit = self.config.max_preemptions_per_request
        for g in reversed(candidates):
            if g.num_preemptions < limit:
                return g
        return candidates[-1]

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        group.num_preemptions += 1
        group.metrics.num_preemptions += 1
        out.preempted.append(group.request_id)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(group):
            mapping = self.block_manager.swap_out(group)
            out.blocks_to_swap_out.extend(mapping)
            self.swapped_blocks["out"] += len(mapping)
            group.set_status(SequenceStatus.SWAPPED)
            self.swapped.append(group)
            self.swapped = deque(sorted(self.swapped, key=lambda g: g.arrival_time))
            mode = "swap"
        else:
            for seq in group.unfinished_seqs:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)
            self.waiting = deque(sorted(self.waiting, key=lambda g: g.arrival_time))
            mode = "recompute"
        self.num_preemptions[mode] += 1
        total = sum(self.num_preemptions.values())
        logger.warning(
            "preempted request %s by %s (blocks ran out); %d preemptions so far",
            group.request_id,
            mode,
            total,
        )
