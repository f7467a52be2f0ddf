"""`TorchPagedBackend.build_metadata`: the slot of every token, the prefill spans and the padded
decode block tables, from block tables held as the block manager holds them (array('i')) or as
lists."""

from __future__ import annotations

from array import array

import pytest
import torch

from engine.attention_backend import TorchPagedBackend
from engine.model_runner import SeqInput
from engine.table_rows import TableRows

BS = 4


@pytest.mark.parametrize("table_type", [lambda ids: array("i", ids), list])
def test_metadata_of_a_mixed_step(table_type):
    seqs = [
        SeqInput([5, 6, 7], 0, table_type([9]), True),  # a new prompt: 3 tokens in block 9
        SeqInput([8, 9], 6, table_type([3, 1]), True),  # a chunk after 6 cached tokens
        SeqInput([4], 9, table_type([2, 0, 7]), False),  # decodes of different lengths
        SeqInput([4], 2, table_type([6]), False),
        SeqInput([4], 4, table_type([11, 12]), False),
    ]
    meta = TorchPagedBackend(BS, torch.device("cpu")).build_metadata(seqs)
    slots = [9 * BS + 0, 9 * BS + 1, 9 * BS + 2, 1 * BS + 2, 1 * BS + 3, 7 * BS + 1, 6 * BS + 2, 12 * BS + 0]
    assert meta.slot_mapping.tolist() == slots
    assert [(p.start, p.end, p.num_cached) for p in meta.prefills] == [(0, 3, 0), (3, 5, 6)]
    assert meta.prefills[0].block_table is None
    assert meta.prefills[1].block_table.dtype == torch.int64 and meta.prefills[1].block_table.tolist() == [3, 1]
    assert meta.num_prefill_tokens == 5
    assert meta.decode_block_tables.dtype == torch.int32
    assert meta.decode_block_tables.tolist() == [[2, 0, 7], [6, 0, 0], [11, 12, 0]]
    assert meta.decode_context_lens.tolist() == [10, 3, 5]
    assert meta.max_decode_context_len == 10


def test_a_step_without_decodes_has_no_decode_tables():
    meta = TorchPagedBackend(BS, torch.device("cpu")).build_metadata([SeqInput([1, 2], 0, array("i", [4]), True)])
    assert meta.decode_block_tables is None and meta.max_decode_context_len == 0
    assert meta.slot_mapping.tolist() == [16, 17]


class _NoCopy:
    """A block table that fails when its blocks are read in bulk (iterated or sliced): the
    decode path over `TableRows` must select the matrix's rows, not copy the tables."""

    def __init__(self, ids):
        self._ids = list(ids)

    def __len__(self):
        return len(self._ids)

    def __getitem__(self, i):
        assert isinstance(i, int), "a decode's table was sliced"
        return self._ids[i]

    def __iter__(self):
        raise AssertionError("a decode's table was iterated")


def test_decode_tables_come_from_the_table_rows_matrix():
    rows = TableRows(num_rows=2, width=2)  # small: the tables below make it grow in both ways
    tables = {1: [2, 0, 7], 2: [6], 3: [11, 12]}
    for seq_id, ids in tables.items():
        rows.assign(seq_id, array("i", ids))
    seqs = [SeqInput([4], 9, _NoCopy(tables[1]), False, None, rows.row_of[1]),
            SeqInput([4], 2, _NoCopy(tables[2]), False, None, rows.row_of[2]),
            SeqInput([4], 4, _NoCopy(tables[3]), False, None, rows.row_of[3])]
    meta = TorchPagedBackend(BS, torch.device("cpu")).build_metadata(seqs, rows)
    assert meta.decode_block_tables.dtype == torch.int32
    assert meta.decode_block_tables.tolist() == [[2, 0, 7], [6, 0, 0], [11, 12, 0]]
    assert meta.slot_mapping.tolist() == [7 * BS + 1, 6 * BS + 2, 12 * BS + 0]
    rows.release(2, 1)  # its row is zeroed and reused
    rows.assign(4, array("i", [5]))
    assert rows.row(4).tolist()[:3] == [5, 0, 0]
