"""`TorchPagedBackend.build_metadata`: the slot of every token, the prefill spans and the padded
decode block tables, from block tables held as the block manager holds them (array('i')) or as
lists."""

from __future__ import annotations

from array import array

import pytest
import torch

from engine.attention_backend import TorchPagedBackend
from engine.model_runner import SeqInput

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
