"""Continuous batching over waiting / running / swapped queues.

Each step: (1) every running request gets a slot for its next token, preempting the newest
running requests when blocks run out; (2) if nothing was preempted, swapped requests come back,
oldest first; (3) if nothing is still swapped out, waiting requests are admitted first come,
first served, within the sequence and token budgets (a prompt is charged for the tokens it
computes this step, not for those the prefix cache serves). Requests join and leave at every step.

Chunked prefill (`enable_chunked_prefill`, off by default): a prompt whose uncomputed tokens exceed
the step's remaining token budget is admitted anyway and prefilled over several steps, each chunk
ending on a block boundary where the budget allows (`_chunk_size`). Decodes are scheduled first,
then the chunks of partially prefilled requests (oldest first), then swapped and waiting ones, so
running requests keep their inter-token latency while a long prompt is prefilled. A request gets
device blocks for its whole prompt at admission, stays RUNNING between its chunks, and samples
only at the chunk that computes its last token (`ScheduledSeq.samples`). Not chunked: a request
whose prompt logprobs are still to be computed (every prompt row must be scored in one step; it
is admitted whole or waits, and the engine refuses one longer than the budget). Samples of one
request recomputed together in chunks share the first one's prompt blocks; the others compute
nothing past those blocks before the first has computed them.

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
    num_tokens: int  # tokens computed for it this step (its uncomputed tail or a chunk of it; 1 when decoding)
    is_prefill: bool  # True when this step computes more than the last token
    block_table: list[int] = field(default_factory=list)  # physical block ids, filled at the end of schedule()
    # False for a prefill chunk that stops short of the sequence's last token: its logits row is
    # ignored and no token is appended (chunked prefill); True otherwise.
    samples: bool = True


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
        prefills: list[ScheduledSeq] = []
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
                self._schedule_decodes(group, decodes, out)
                kept.append(group)
        self.running = kept
        budget_seqs -= sum(len(g.seqs_with_status(SequenceStatus.RUNNING)) for g in kept)
        budget_tokens -= sum(s.num_tokens for s in decodes)
        # (1b) Partially prefilled requests (chunked prefill) continue, after every decode.
        for group in kept:
            budget_tokens -= self._schedule_prefill_chunks(group, budget_tokens, prefills)

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
                budget_tokens -= self._schedule_decodes(group, decodes, out)
                # NOTE: one swapped out during its chunked prefill goes on prefilling.
                budget_tokens -= self._schedule_prefill_chunks(group, budget_tokens, prefills)
                self.running.append(group)
                budget_seqs -= n

        # (3) Waiting requests, first come first served.
        if not out.preempted and not self.swapped:
            while self.waiting:
                group = self.waiting[0]
                seqs = group.seqs_with_status(SequenceStatus.WAITING)
                # NOTE: the token budget is charged for what this step computes: a prompt's
                # prefix-cache hits cost nothing.
                num_tokens = self.block_manager.num_tokens_to_compute(group)
                whole = not self._may_chunk(group)
                if len(seqs) > budget_seqs or (num_tokens > budget_tokens if whole else budget_tokens < 1):
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
                # NOTE: a chunked prompt publishes no prefix-cache hashes for blocks it has not
                # computed yet; the engine registers each block once its chunk has run.
                self.block_manager.allocate(group, register=whole)
                first_admission = group.metrics.first_scheduled_time is None
                for seq in seqs:
                    if first_admission:
                        group.num_cached_tokens = seq.num_computed_tokens
                    seq.status = SequenceStatus.RUNNING
                    if whole:
                        prefills.append(ScheduledSeq(seq, group, seq.num_uncomputed_tokens, True))
                if whole:
                    budget_tokens -= sum(s.num_uncomputed_tokens for s in seqs)
                else:
                    budget_tokens -= self._schedule_prefill_chunks(group, budget_tokens, prefills)
                self.running.append(group)
                budget_seqs -= len(seqs)
        self.running.sort(key=lambda g: g.arrival_time)
        out.scheduled = prefills + decodes
        for s in out.scheduled:
            s.block_table = self.block_manager.block_table(s.seq)
        out.num_batched_tokens = sum(s.num_tokens for s in out.scheduled)
        return out

    # ---------------------------------------------------------------- helpers of schedule()
    @staticmethod
    def _is_prefilling(seq: Sequence) -> bool:
        """Whether a running sequence is part way through a (chunked) prefill: it has sampled
        nothing yet, or more than its last token is uncomputed (a recompute in chunks).
        NOTE: a recomputed sequence with only its last token left is simply decoded."""
        return not seq.output_token_ids or seq.num_uncomputed_tokens > 1

    def _may_chunk(self, group: SequenceGroup) -> bool:
        """Whether the waiting group may be prefilled in chunks: chunked prefill is on and its
        prompt logprobs (which need every prompt row in one step) are not still to be computed."""
        pending_logprobs = group.params.prompt_logprobs is not None and group.prompt_logprobs is None
        return self.config.enable_chunked_prefill and not pending_logprobs

    def _schedule_decodes(self, group: SequenceGroup, decodes: list[ScheduledSeq], out: SchedulerOutput) -> int:
        """A slot for the next token of each of the group's running sequences that decodes
        (`can_append_slots` said yes); appends them to `decodes`. Returns how many."""
        n = 0
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        lead = seqs[0] if seqs and self._is_prefilling(seqs[0]) else None
        for seq in seqs:
            if self._is_prefilling(seq):
                continue  # its blocks were all allocated at admission
            if lead is not None and seq.num_computed_tokens > lead.num_computed_tokens:
                # NOTE: a sample recomputed with its siblings counts the prompt blocks it shares
                # with the first as computed (BlockManager.allocate); it waits for them.
                continue
            cow = self.block_manager.append_slot(seq)
            if cow is not None:
                out.blocks_to_copy.append(cow)
            decodes.append(ScheduledSeq(seq, group, seq.num_uncomputed_tokens, False))
            n += 1
        return n

    def _schedule_prefill_chunks(self, group: SequenceGroup, budget: int, prefills: list[ScheduledSeq]) -> int:
        """The next chunk of each of the group's running sequences that is still prefilling,
        within `budget` tokens; appends them to `prefills`. Returns the tokens scheduled.
        Without chunked prefill no running sequence is ever part way through its prefill."""
        used = 0
        lead_end: int | None = None  # what the group's first prefilling sequence has computed after this step
        for seq in group.seqs_with_status(SequenceStatus.RUNNING):
            if not self._is_prefilling(seq):
                continue
            if lead_end is not None and seq.num_computed_tokens > lead_end:
                # NOTE: samples recomputed together share the first one's prompt blocks
                # (BlockManager.allocate); one waits until those are computed (in this step
                # at the latest: every layer writes the step's K/V before attending).
                continue
            n = self._chunk_size(seq, budget - used)
            if n == 0:
                break
            if lead_end is None:
                lead_end = seq.num_computed_tokens + n
            prefills.append(ScheduledSeq(seq, group, n, True, samples=n == seq.num_uncomputed_tokens))
            used += n
        return used

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """How many of the sequence's uncomputed tokens to compute within `budget`: all if they
        fit; otherwise the budget, cut back so the chunk ends on a block boundary unless that
        leaves nothing. 0 when the budget is spent."""
        n = seq.num_uncomputed_tokens
        if n <= budget:
            return n
        if budget <= 0:
            return 0
        bs = self.block_manager.block_size
        end = (seq.num_computed_tokens + budget) // bs * bs
        return end - seq.num_computed_tokens if end > seq.num_computed_tokens else budget

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
