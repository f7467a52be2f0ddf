"""The step's plain objects, which both the scheduler side and the worker side import (so that
the model runner and a tensor-parallel worker never load the scheduler):

- `SchedulerOutput` (of `ScheduledSeq`s): what `Scheduler.schedule()` hands to the engine for
  one step; no tensors.
- `StepInput` (of `SeqInput`s): the lean, picklable description of the step that the driver
  builds from it and sends to every rank: token ids, positions and block tables, never
  `Sequence` objects.
- `StepOutput` (of `SampleResult`s): what `ModelRunner.execute` returns, and the per-token
  result of sampling or scoring.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.core.sequence import Sequence, SequenceGroup
from engine.core.table_rows import BlockTable, TableRows, new_table


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence  # the sequence to run
    group: SequenceGroup  # its request
    num_tokens: int  # tokens computed for it this step (its uncomputed tail or a chunk of it; 1 when decoding)
    is_prefill: bool  # True when this step computes more than the last token
    # Physical block ids: the block manager's live table (not a copy), valid until the block
    # manager changes again (the step has run).
    block_table: BlockTable = field(default_factory=new_table)
    # The tables of KV layer groups 1.. (engine/core/kv_layout.py), live arrays too; () with one group.
    group_tables: tuple[BlockTable, ...] = ()
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


@dataclass(slots=True)
class SampleResult:
    token_id: int
    # Raw model log-probability of token_id, and its 1-based rank in the raw distribution; None
    # for a row that needs neither (no logprobs asked, no best_of ranking: `needs_scores`).
    logprob: float | None
    rank: int | None
    # The params.logprobs most likely raw tokens, best first; None when params.logprobs is None.
    top_logprobs: list[tuple[int, float]] | None


# Prompt-logprob rows that go through the LM head at a time (the default of
# `StepInput.logit_chunk_rows`): the step's peak is this many full-vocabulary rows and a few
# temporaries of that size, whatever the prompts' lengths.
PROMPT_LOGPROB_CHUNK_ROWS = 256


@dataclass(slots=True)
class SeqInput:
    """One scheduled sequence, as the model sees it."""

    token_ids: list[int]  # tokens whose K/V this step computes (the scheduled slice; one when decoding)
    start: int  # position of token_ids[0]: tokens of this sequence already in the cache
    # physical block ids covering positions [0, start + len(token_ids)) (the block manager's array)
    block_table: array | list[int]
    is_prefill: bool  # True when this step computes more than the last token
    # Prompt logprobs' k: also score token_ids[1:], each under the output at the position before
    # it, with its k best alternatives (see `StepOutput.prompt_scores`). None: no scores.
    prompt_logprobs: int | None = None
    block_row: int = -1  # a decode's row in `StepInput.table_rows` (-1: none)
    # With prompt_logprobs, a chunk short of the prompt's end: the prompt token after
    # token_ids, which the last row scores too (-1: none).
    score_next: int = -1
    seq_id: int = -1  # the sequence's id: its table's key in a worker's persistent batch
    # KV layer groups 1..'s tables (engine/core/kv_layout.py), as `block_table`; () with one group
    group_tables: tuple = ()

    @property
    def score_targets(self) -> list[int]:
        """The tokens this sequence's rows score, in row order (prompt logprobs only)."""
        return self.token_ids[1:] + [self.score_next] if self.score_next >= 0 else self.token_ids[1:]


@dataclass
class StepInput:
    """Everything a rank needs to run one step; plain lists and ints, cheap to pickle."""

    seqs: list[SeqInput] = field(default_factory=list)  # prefills first, then decodes
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Prompt-logprob rows per LM-head call. NOTE: sent with the step rather than read from each
    # rank's module constant: every rank must make the same calls, since they gather vocab shards.
    logit_chunk_rows: int = PROMPT_LOGPROB_CHUNK_ROWS
    # The block manager's tables as matrix rows; None on a tensor-parallel worker (not pickled).
    table_rows: TableRows | None = None
    # The device tables' changes since the last step (`SchedulerOutput.table_changes`): all a
    # tensor-parallel worker is sent of the tables (engine/worker/persistent_batch.py).
    table_changes: list[tuple] = field(default_factory=list)

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput, prompt_logprobs: Mapping[int, int] | None = None) -> "StepInput":
        """Read before the block manager changes again (the tables are its live arrays).
        `prompt_logprobs`: indices into `out.scheduled` of prefills whose rows score prompt
        tokens with their request's `params.prompt_logprobs` alternatives (see
        `ModelRunner.execute`), each mapped to its `SeqInput.score_next`."""
        prompt_logprobs = prompt_logprobs or {}
        seqs = []
        row_of = out.table_rows.row_of if out.table_rows is not None else {}
        for i, s in enumerate(out.scheduled):
            seq, start = s.seq, s.start
            ids = seq.tokens(start, start + s.num_tokens) if s.is_prefill else [seq.last_token_id]
            scored = s.is_prefill and i in prompt_logprobs
            k = s.group.params.prompt_logprobs if scored else None
            # NOTE: the block table is the block manager's live list, not a copy: it is read
            # before the block manager changes again (pickled for tensor-parallel workers).
            row = -1 if s.is_prefill else row_of.get(seq.seq_id, -1)
            seqs.append(SeqInput(ids, start, s.block_table, s.is_prefill, k, row,
                                 prompt_logprobs[i] if scored else -1, seq.seq_id, s.group_tables))
        return cls(seqs, list(out.blocks_to_swap_in), list(out.blocks_to_swap_out), list(out.blocks_to_copy),
                   PROMPT_LOGPROB_CHUNK_ROWS, out.table_rows, out.table_changes)


@dataclass
class StepOutput:
    """What `ModelRunner.execute` returns for one step."""

    # float32 [len(step.seqs), vocab]: row i is the output at seqs[i]'s last token (the engine
    # ignores it for a prefill chunk that stops short of the prompt's end)
    logits: torch.Tensor
    # One per sequence of the step: for one with `prompt_logprobs` k, a SampleResult (raw
    # logprob, rank, k alternatives) per token of `score_targets`, in order; otherwise None. Only
    # the driver (rank 0) scores: other ranks' results are never used, and hold None throughout.
    prompt_scores: list[list[SampleResult] | None] = field(default_factory=list)
