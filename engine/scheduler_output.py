"""What `Scheduler.schedule()` hands to the engine for one step: plain dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockTable, new_table
from engine.sequence import Sequence, SequenceGroup
from engine.table_rows import TableRows


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence  # the sequence to run
    group: SequenceGroup  # its request
    num_tokens: int  # tokens computed for it this step (its uncomputed tail or a chunk of it; 1 when decoding)
    is_prefill: bool  # True when this step computes more than the last token
    # Physical block ids: the block manager's live table (not a copy), valid until the block
    # manager changes again (the step has run).
    block_table: BlockTable = field(default_factory=new_table)
    # False for a prefill chunk that stops short of the sequence's last token: its logits row is
    # ignored and no token is appended (chunked prefill); True otherwise.
    samples: bool = True
    start: int = 0  # the tokens of `seq` computed before this step (the position of the first one it computes)

    @property
    def context_tokens(self) -> int:
        """The tokens this step attends over for `seq` (computed before it plus this step's)."""
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs. The model runner carries it out; nothing here is a tensor."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # prefills first, then decodes
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[str] = field(default_factory=list)  # request ids preempted (or parking a sample) this step
    num_batched_tokens: int = 0  # sum of num_tokens
    # the block manager's device tables as matrix rows (read-only here, like `block_table`)
    table_rows: TableRows | None = None
    # the device tables' changes since the last step (`TableRows.take_changes`, oldest first):
    # what a tensor-parallel worker applies to its own copy of the tables
    table_changes: list[tuple] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)
