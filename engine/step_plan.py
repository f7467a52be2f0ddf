"""`StepPlan`: the step a `Scheduler.schedule()` call is building: its output, what is left of the
token budget, and what runs. Scheduling a request's sequences (decodes take a slot for their next
token, prefills their next chunk) and taking it back (a parked sample) happen here; which
requests run is the scheduler's."""

from __future__ import annotations

from collections.abc import Iterable

from engine.block_manager import AdmissionPlan, BlockManager
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


def logprobs_pending(group: SequenceGroup) -> bool:
    """The request's prompt logprobs are still to be computed (at its first prefill)."""
    return group.params.prompt_logprobs is not None and group.prompt_logprobs is None


def all_at_once(group: SequenceGroup) -> bool:
    """Whether the group's waiting sequences come in together: beams (they sample together)
    and a request whose prompt logprobs are still to be computed."""
    return group.is_beam_search or logprobs_pending(group)


def has_waiting(group: SequenceGroup) -> bool:
    """Whether a sequence of the group waits (a parked sample, or a prompt not yet admitted)."""
    seqs = group.seqs
    return seqs[0].status == _WAITING if len(seqs) == 1 else any(s.status == _WAITING for s in seqs)


class StepPlan:
    def __init__(self, out: SchedulerOutput, tokens: int, block_manager: BlockManager, chunked: bool) -> None:
        self.out = out
        self.tokens = tokens  # what is left of max_num_batched_tokens
        self.block_manager = block_manager
        self.chunked = chunked  # enable_chunked_prefill
        self.prefills: list[ScheduledSeq] = []
        self.decodes: list[ScheduledSeq] = []
        # seq id -> (what this step runs of it, the copy-on-write pair its slot took, if any)
        self.scheduled: dict[int, tuple[ScheduledSeq, tuple[int, int] | None]] = {}

    def computed_after(self, seq: Sequence) -> int:
        """The sequence's num_computed_tokens once this step has run."""
        entry = self.scheduled.get(seq.seq_id)
        return seq.num_computed_tokens + (entry[0].num_tokens if entry else 0)

    def may_chunk(self, group: SequenceGroup) -> bool:
        """Whether the group's prefills may be split over steps: chunked prefill is on and its
        prompt logprobs (which need every prompt row in one step) are not still to be computed."""
        return self.chunked and not logprobs_pending(group)

    def prefill_fits(self, group: SequenceGroup, seqs_or_plan: list[Sequence] | AdmissionPlan) -> bool:
        """Whether the step's token budget takes these waiting sequences' prefill: all of it
        without chunking, a first chunk with it."""
        if self.may_chunk(group):
            return self.tokens >= 1
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
            if cow is not None:
                self.out.blocks_to_copy.remove(cow)

    def schedule_group(self, group: SequenceGroup, *, decode: bool, prefill: bool,
                        only: Iterable[Sequence] | None = None, oldest: bool = False) -> None:
        """Schedule the group's running sequences (or `only` these), in index order, within the
        step's token budget: decodes (`decode`) take a slot for their next token, prefills
        (`prefill`) their next chunk (or all their uncomputed tokens without chunking).
        Beams decode together or not at all; recomputed beams stop a token short. `oldest`:
        the oldest request, scheduled first, whose prefill that cannot be chunked (its prompt
        logprobs) runs whole even past the budget, so that any prompt within max_model_len can
        ask for prompt logprobs."""
        if only is None and len(group.seqs) == 1:
            # NOTE: the common case, for every request at every step: one sequence, no beams.
            seq = group.seqs[0]
            if seq.status == _RUNNING and seq.seq_id not in self.scheduled and self.tokens >= 1:
                n = len(seq) - seq.num_computed_tokens  # uncomputed
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
            if any(self._is_prefilling(s) for s in seqs):
                decode = False  # the others wait until every beam can sample
            elif decode and len(seqs) > self.tokens:
                return
        for seq in seqs:
            if seq.seq_id in self.scheduled or self.tokens < 1:
                continue
            if not self._is_prefilling(seq):
                if decode and self._caught_up(seq):
                    self._decode(seq, group, seq.num_uncomputed_tokens)
            elif prefill:
                chunks = self.may_chunk(group)
                n = self._chunk_size(seq, self.tokens) if chunks else seq.num_uncomputed_tokens
                if beams:
                    n = min(n, seq.num_uncomputed_tokens - 1)
                # NOTE: past the budget only for the oldest's prompt-logprob prefill with
                # chunking on, in a step that holds nothing else yet: it runs alone.
                whole = oldest and self.chunked and not chunks and not self.scheduled
                if 0 < n and (n <= self.tokens or whole) and self._caught_up(seq):
                    self._add(ScheduledSeq(seq, group, n, True, self.block_manager.tables[seq.seq_id],
                                           samples=n == seq.num_uncomputed_tokens))

    def schedule_chunks(self, running: list[SequenceGroup], oldest: SequenceGroup | None) -> None:
        """After the decodes: the prefill chunks of `running` requests (but `oldest`, scheduled
        first) that still have a running sequence with nothing scheduled, in order."""
        for group in running:
            if group is not oldest and self.has_unscheduled(group):
                self.schedule_group(group, decode=False, prefill=True)

    def has_unscheduled(self, group: SequenceGroup) -> bool:
        """Whether a running sequence of the group has nothing scheduled this step."""
        seqs, scheduled = group.seqs, self.scheduled
        if len(seqs) == 1:
            return seqs[0].status == _RUNNING and seqs[0].seq_id not in scheduled
        return any(s.seq_id not in scheduled for s in seqs if s.status == _RUNNING)

    def _decode(self, seq: Sequence, group: SequenceGroup, n: int) -> None:
        """Schedule `seq`'s next token (`n`: its uncomputed tokens): a slot for it (copying a
        shared last block if need be)."""
        bm = self.block_manager
        cow = bm.append_slot(seq)
        if cow is not None:
            self.out.blocks_to_copy.append(cow)
        self._add(ScheduledSeq(seq, group, n, False, bm.tables[seq.seq_id]), cow)

    def _add(self, s: ScheduledSeq, cow: tuple[int, int] | None = None) -> None:
        (self.prefills if s.is_prefill else self.decodes).append(s)
        self.tokens -= s.num_tokens
        self.scheduled[s.seq.seq_id] = (s, cow)

    def _caught_up(self, seq: Sequence) -> bool:
        """Whether the sibling whose prompt blocks `seq` shares (`waits_for`) will have computed
        them by the end of this step (every layer writes the step's K/V before attending)."""
        if seq.waits_for is None:
            return True
        lead, shared = seq.waits_for
        if lead.num_computed_tokens >= shared:
            seq.waits_for = None
            return True
        return self.computed_after(lead) >= shared

    @staticmethod
    def _is_prefilling(seq: Sequence) -> bool:
        """Whether a running sequence is part way through a prefill: it has sampled nothing
        yet, or more than its last token is uncomputed (a recompute).
        NOTE: a recomputed sequence with only its last token left is simply decoded."""
        return not seq.output_token_ids or seq.num_uncomputed_tokens > 1

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
