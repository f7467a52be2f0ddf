"""`StepPlan`: the step a `Scheduler.schedule()` call is building: its output, what is left of the
token budget, and what runs. Scheduling a request's sequences (decodes take a slot for their next
token, prefills their next chunk) and taking it back (a parked sample) happen here; which
requests run is the scheduler's. It reads the block manager (plans, computed tokens, tables)
but never changes it: a decode's slot is taken through the scheduler's `take_slot`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

from engine.core.config import SchedulerConfig
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.step import ScheduledSeq, SchedulerOutput
from engine.kv.block_manager import AdmissionPlan, BlockManager
from engine.sched.step_cost import StepCost

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


def all_at_once(group: SequenceGroup) -> bool:
    """Whether the group's waiting sequences come in together: beams (they sample together)."""
    return group.is_beam_search


def has_waiting(group: SequenceGroup) -> bool:
    """Whether a sequence of the group waits (a parked sample, or a prompt not yet admitted)."""
    seqs = group.seqs
    return seqs[0].status == _WAITING if len(seqs) == 1 else any(s.status == _WAITING for s in seqs)


@dataclass(frozen=True)
class PrefillCap:
    """The step-time target for this step (engine/sched/step_cost.py): once
    decodes run, the prefill chunks of requests that arrived less than `wait_s` ago are cut so
    that the step's estimated time stays within `step_s`, with at least `floor` prefill tokens in
    the step; unless the prefill backlog (`backlog`) is more than capped steps would clear within
    `wait_s`."""
    cost: StepCost
    step_s: float
    wait_s: float | None  # None: no request is exempt for its wait, no backlog lifts the cap
    now: float  # the clock at this step (the requests' arrival_time's clock)
    floor: int
    backlog: Callable[[int], int]  # the prompt tokens still to prefill, counted up to a limit
    queued: Callable[[int], tuple[int, int]]  # (rows, prompt tokens) still to prefill, counted up to a number of rows
    max_rows: int  # max_num_seqs: the most sequences a step decodes

    @staticmethod
    def cost_for(config: SchedulerConfig) -> StepCost | None:
        """A fresh cost model when `config` sets a step-time target (logged), else None."""
        if config.target_itl_ms is None or not config.enable_chunked_prefill:
            return None
        wait = _exempting_wait_s(config)
        exempt = (f"requests waiting past {wait * 1000:g} ms exempt" if wait is not None
                  else "only the oldest request exempt")
        logger.info("step-time target: prefill chunks cut to keep a step with decodes within %g ms (%s)",
                    config.target_itl_ms, exempt)
        return StepCost()

    @classmethod
    def of(cls, sched) -> PrefillCap | None:
        """The scheduler's cap for the step it is about to plan; None without a target.
        `sched`: the `Scheduler` (its config, step_cost, clock, block_manager, running, waiting).
        NOTE: not imported for the annotation: scheduler.py imports this module."""
        cfg, cost = sched.config, sched.step_cost
        if cost is None:  # NOTE: cost_for gives a cost model only with a target
            return None
        bm = sched.block_manager
        return cls(cost, cfg.target_itl_ms / 1000.0, _exempting_wait_s(cfg), sched.clock(), bm.block_size,
                   lambda limit: prefill_backlog(sched.running, sched.waiting, limit, bm),
                   lambda rows: queued_decodes(sched.running, sched.waiting, rows), cfg.max_num_seqs)


def _exempting_wait_s(config: SchedulerConfig) -> float | None:
    """`PrefillCap.wait_s`: target_ttft_ms in seconds under fcfs; None under shortest-prompt.
    NOTE: under shortest-prompt no wait exempts a request and no backlog lifts the cap. The
    queue is served shortest first, so what the cap holds back is the longest prompts, which
    that order puts last anyway; lifting it let them take whole-budget steps while the most
    streams decode (a burst at 16 streams: ITL p99 294-388 ms in four runs, 212 without the
    lifts; docs/using.md). The oldest request is never cut (liveness)."""
    if config.target_ttft_ms is None or config.scheduling_policy != "fcfs":
        return None
    return config.target_ttft_ms / 1000.0


def _unsampled(running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup]) -> Iterator[SequenceGroup]:
    """The requests that have not sampled their first token: running ones part way through
    their prompt, then waiting ones."""
    for group in chain(running, waiting):
        if not group.seqs[0].output_token_ids:
            yield group


def prefill_backlog(running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup], limit: int,
                    bm: BlockManager) -> int:
    """The uncomputed tokens of the requests that have not sampled their first token, counted
    until they pass `limit` (NOTE: so the count stops after at most `limit` waiting requests,
    however long the queue)."""
    total = 0
    for group in _unsampled(running, waiting):
        total += bm.num_uncomputed_tokens(group.seqs[0])
        if total > limit:
            break
    return total


def queued_decodes(running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup], rows: int) -> tuple[int, int]:
    """(sequences, prompt tokens) of the requests that have not sampled their first token: the
    decodes they will add once prefilled, each counted as its samples (best_of), at most `rows`
    in all, and the context those attend to. Counting stops there (NOTE: so it stops after at
    most `rows` requests, however long the queue)."""
    seqs = tokens = 0
    for group in _unsampled(running, waiting):
        seqs += group.num_seqs_reserved
        tokens += len(group.seqs[0])
        if seqs >= rows:
            break
    return min(seqs, rows), tokens


class StepPlan:
    def __init__(self, out: SchedulerOutput, tokens: int, block_manager: BlockManager,
                 take_slot: Callable[[Sequence], tuple[tuple[int, int], ...] | None], chunked: bool,
                 cap: PrefillCap | None = None) -> None:
        """`block_manager`: read only here. `take_slot(seq)`: the scheduler's, makes the slot of
        a decode's next token (a copy-on-write (src, dst) pair, or None)."""
        self.out = out
        self.tokens = tokens  # what is left of max_num_batched_tokens
        self.block_manager = block_manager
        self.take_slot = take_slot
        self.chunked = chunked  # enable_chunked_prefill
        self.cap = cap
        # the capped prefill tokens this step has left (None until a capped prefill asks)
        self.prefill_left: int | None = None
        self.prefills: list[ScheduledSeq] = []
        self.decodes: list[ScheduledSeq] = []
        # seq id -> (what this step runs of it, the copy-on-write pair its slot took, if any)
        self.scheduled: dict[int, tuple[ScheduledSeq, tuple[int, int] | None]] = {}

    def computed_after(self, seq: Sequence) -> int:
        """The sequence's num_computed_tokens once this step has run."""
        entry = self.scheduled.get(seq.seq_id)
        return self.block_manager.num_computed_tokens(seq) + (entry[0].num_tokens if entry else 0)

    def prefill_fits(self, group: SequenceGroup, seqs_or_plan: list[Sequence] | AdmissionPlan) -> bool:
        """Whether the step's token budget takes these waiting sequences' prefill: all of it
        without chunking, a first chunk with it."""
        if self.chunked:
            return self.prefill_budget(group) >= 1
        plan = seqs_or_plan if isinstance(seqs_or_plan, AdmissionPlan) else self.block_manager.plan(group, seqs_or_plan)
        return plan.num_new_tokens <= self.tokens

    @staticmethod
    def is_multi_beam(group: SequenceGroup) -> bool:
        """A beam search past its first step: its beams sample together."""
        return group.is_beam_search and len(group.unfinished_seqs) > 1

    def unschedule(self, seq: Sequence) -> None:
        """Take back what this step scheduled for `seq` (before its blocks are freed)."""
        entry = self.scheduled.pop(seq.seq_id, None)
        if entry is not None:
            scheduled, cow = entry
            (self.prefills if scheduled.is_prefill else self.decodes).remove(scheduled)
            self.tokens += scheduled.num_tokens
            # NOTE: the step-time cap (prefill_left) is not given back: a step only gets shorter
            for pair in cow or ():
                self.out.blocks_to_copy.remove(pair)

    def schedule_group(self, group: SequenceGroup, *, decode: bool, prefill: bool,
                        only: Iterable[Sequence] | None = None, oldest: bool = False) -> None:
        """Schedule the group's running sequences (or `only` these), in index order, within the
        step's token budget: decodes (`decode`) take a slot for their next token, prefills
        (`prefill`) their next chunk (or all their uncomputed tokens without chunking).
        Beams decode together or not at all; recomputed beams stop a token short. `oldest`:
        the oldest request, scheduled first, whose chunk the step-time cap does not cut.
        NOTE: a request with prompt logprobs chunks like any other (each chunk scores its own
        rows, engine/sample/prompt_logprobs.py), so no request's prefill runs past the budget."""
        if only is None and len(group.seqs) == 1:
            # NOTE: the common case, for every request at every step: one sequence, no beams.
            seq = group.seqs[0]
            if seq.status == _RUNNING and seq.seq_id not in self.scheduled and self.tokens >= 1:
                n = self.block_manager.num_uncomputed_tokens(seq)
                if n <= 1 and seq.output_token_ids:  # decoding
                    if decode and self._caught_up(seq):
                        self._decode(seq, group, n)
                    return
                only = (seq,)
            else:
                return
        seqs = list(only) if only is not None else group.seqs_with_status(_RUNNING)
        beams = self.is_multi_beam(group)
        if beams:
            if any(self._is_prefilling(s, self.block_manager.num_uncomputed_tokens(s)) for s in seqs):
                decode = False  # the others wait until every beam can sample
            elif decode and len(seqs) > self.tokens:
                return
        bm = self.block_manager
        for seq in seqs:
            if seq.seq_id in self.scheduled or self.tokens < 1:
                continue
            uncomputed = bm.num_uncomputed_tokens(seq)
            if not self._is_prefilling(seq, uncomputed):
                if decode and self._caught_up(seq):
                    self._decode(seq, group, uncomputed)
            elif prefill:
                n = self._chunk_size(seq, self.prefill_budget(group, oldest)) if self.chunked else uncomputed
                if beams:
                    n = min(n, uncomputed - 1)
                if 0 < n <= self.tokens and self._caught_up(seq):
                    self._add(ScheduledSeq(seq, group, n, True, bm.block_table(seq), bm.group_block_tables(seq),
                                           samples=n == uncomputed, start=len(seq) - uncomputed))

    def schedule_chunks(self, running: list[SequenceGroup], oldest: SequenceGroup | None,
                        defer_over: int | None = None) -> list[SequenceGroup]:
        """After the decodes: the prefill chunks of `running` requests (but `oldest`, scheduled
        first) that still have a running sequence with nothing scheduled, in order. With
        `defer_over`, a request with more uncomputed tokens than that is skipped and returned
        (shortest-prompt: it goes after the shorter fresh prompts)."""
        deferred = []
        for group in running:
            if group is not oldest and self.has_unscheduled(group):
                if defer_over is not None and self.block_manager.num_uncomputed_tokens(group.seqs[0]) > defer_over:
                    deferred.append(group)
                else:
                    self.schedule_group(group, decode=False, prefill=True)
        return deferred

    def has_unscheduled(self, group: SequenceGroup) -> bool:
        """Whether a running sequence of the group has nothing scheduled this step."""
        seqs, scheduled = group.seqs, self.scheduled
        if len(seqs) == 1:
            return seqs[0].status == _RUNNING and seqs[0].seq_id not in scheduled
        return any(s.seq_id not in scheduled for s in seqs if s.status == _RUNNING)

    def _decode(self, seq: Sequence, group: SequenceGroup, n: int) -> None:
        """Schedule `seq`'s next token (`n`: its uncomputed tokens): a slot for it (copying a
        shared last block if need be, `take_slot`)."""
        cow = self.take_slot(seq)
        if cow is not None:
            self.out.blocks_to_copy.extend(cow)
        bm = self.block_manager
        self._add(ScheduledSeq(seq, group, n, False, bm.block_table(seq), bm.group_block_tables(seq),
                               start=len(seq) - n), cow)

    def prefill_budget(self, group: SequenceGroup, oldest: bool = False) -> int:
        """The tokens a chunkable prefill of `group` may take now: what is left of the budget,
        and under the step-time cap (once decodes run, unless `group` is the oldest request or
        has waited past the cap's wait) what is left of that too."""
        cap = self.cap
        if cap is None or oldest or not self.decodes:
            return self.tokens
        if cap.wait_s is not None and cap.now - group.arrival_time > cap.wait_s:
            return self.tokens
        if self.prefill_left is None:
            context = sum(s.context_tokens for s in self.decodes)
            fits = cap.cost.prefill_tokens_within(cap.step_s, len(self.decodes), context)
            # NOTE: decodes that alone take half the target or more: a cap would spread each
            # prompt over twice as many steps or more, moving its wait into TTFT while the
            # streams' gaps stay near the decodes' own time (at 64 streams on a 2-core CPU it
            # raised ITL p50 and second-wave TTFT, ITL p99 unchanged; docs/using.md). Counted
            # with the decodes of the requests still to prefill (up to max_num_seqs rows): the
            # running decodes alone let the cap hold a 64-stream burst at ~48 decodes, under
            # half the target, for good (prompts prefilled as fast as streams finish), with
            # TTFT p50 1.6-2.0 s instead of 0.82-0.93 s in 5 runs of 21.
            if fits is not None:
                room = cap.max_rows - len(self.decodes)
                queued, prompts = cap.queued(room) if room > 0 else (0, 0)
                if cap.cost.predict(len(self.decodes) + queued, 0, context + prompts) >= cap.step_s / 2:
                    fits = None
            if fits is not None:
                fits = max(fits, cap.floor)
                # NOTE: a backlog that capped steps clear only after wait_s: the cap would
                # only move the queue's wait into TTFT, so the step takes the whole budget.
                if cap.wait_s is not None:
                    limit = int(fits * cap.wait_s / cap.step_s)
                    if cap.backlog(limit) > limit:
                        fits = None
            if fits is None:  # still learning, the decodes alone near the target, or a long backlog: no cap
                self.cap = None
                return self.tokens
            already = sum(s.num_tokens for s in self.prefills)
            self.prefill_left = max(fits - already, 0)
        return min(self.tokens, self.prefill_left)

    def _add(self, s: ScheduledSeq, cow: tuple[tuple[int, int], ...] | None = None) -> None:
        (self.prefills if s.is_prefill else self.decodes).append(s)
        self.tokens -= s.num_tokens
        if s.is_prefill and self.prefill_left is not None:
            self.prefill_left = max(self.prefill_left - s.num_tokens, 0)
        self.scheduled[s.seq.seq_id] = (s, cow)

    def _caught_up(self, seq: Sequence) -> bool:
        """Whether the sibling whose prompt blocks `seq` shares (`BlockManager.pending_share`)
        will have computed them by the end of this step (every layer writes the step's K/V
        before attending)."""
        pending = self.block_manager.pending_share(seq)
        return pending is None or self.computed_after(pending[0]) >= pending[1]

    @staticmethod
    def _is_prefilling(seq: Sequence, uncomputed: int) -> bool:
        """Whether a running sequence (with `uncomputed` tokens) is part way through a prefill:
        it has sampled nothing yet, or more than its last token is uncomputed (a recompute).
        NOTE: a recomputed sequence with only its last token left is simply decoded."""
        return not seq.output_token_ids or uncomputed > 1

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """How many of the sequence's uncomputed tokens to compute within `budget`: all if they
        fit; otherwise the budget, cut back so the chunk ends on a block boundary unless that
        leaves nothing. 0 when the budget is spent."""
        bm = self.block_manager
        computed = bm.num_computed_tokens(seq)
        n = len(seq) - computed
        if n <= budget:
            return n
        if budget <= 0:
            return 0
        end = (computed + budget) // bm.block_size * bm.block_size
        return end - computed if end > computed else budget
