"""A tensor-parallel worker's copy of the device block tables, kept from step to step (vLLM's
persistent batch), so that the driver sends each step only what changed in them.

Why: the step used to carry every scheduled sequence's whole block table, pickled and broadcast
to every worker: O(batch x context) bytes a step (64 sequences of 2,000 tokens: ~125 block ids
each). The block manager's `TableRows` logs every write to the device tables in order
(`take_changes`); the driver sends that log with the step instead (`for_workers`): new and
moved tables whole, once; then the one block id a sequence gains every `block_size` tokens or
a copy-on-write replaces; then a removal. Per step that is O(batch), whatever the context.

Contract: every change reaches the workers exactly once and in order. The scheduler drains the
log once per step into `SchedulerOutput.table_changes`; the executor sends every step's changes,
holding back those of a step it does not send (`MultiProcessExecutor`), and each worker applies
them before the step they came with (`PersistentBatch.restore`).
"""

from __future__ import annotations

import dataclasses
from array import array

from engine.core.step import StepInput


def for_workers(step: StepInput, earlier: list[tuple] = ()) -> StepInput:
    """`step` as the driver sends it to the workers: no block tables (each `SeqInput` keeps its
    `seq_id`), the table changes of `earlier` unsent steps followed by this step's."""
    seqs = [dataclasses.replace(s, block_table=()) for s in step.seqs]
    changes = list(earlier) + step.table_changes if earlier else step.table_changes
    return dataclasses.replace(step, seqs=seqs, table_rows=None, table_changes=changes)


class PersistentBatch:
    """The device block tables as the driver's block manager holds them, rebuilt on a worker
    from the changes each step brings."""

    def __init__(self) -> None:
        self.tables: dict[int, array] = {}  # seq_id -> device block ids

    def apply(self, changes: list[tuple]) -> None:
        """Apply `TableRows` changes, oldest first (the module docstring gives their forms)."""
        tables = self.tables
        for change in changes:
            if len(change) == 3:  # the common one: an entry (a new last block, a copy-on-write)
                seq_id, i, block_id = change
                table = tables[seq_id]
                if i == len(table):
                    table.append(block_id)
                else:
                    table[i] = block_id
            elif len(change) == 2:
                tables[change[0]] = array("i", change[1])
            else:
                del tables[change[0]]

    def restore(self, step: StepInput) -> StepInput:
        """The step as the driver runs it: apply its changes, then give each sequence its table.
        Raises KeyError if a scheduled sequence has no table here (a change was lost)."""
        self.apply(step.table_changes)
        for s in step.seqs:
            s.block_table = self.tables[s.seq_id]
        return step
