"""`TorchPagedBackend.build_metadata`: the slot of every token, the prefill spans and the padded
decode block tables, from block tables held as the block manager holds them (array('i')) or as
lists. `forward` on a CPU: the one-call prefill kernel gives what the SDPA loop gives, for
prompts, chunks after cached tokens and decodes in one step, in fp32 (the kernel) and bf16 (the
loop, reading the cached prefix through the same tables)."""

from __future__ import annotations

from array import array

import pytest
import torch

from cuda_ext import ops
from engine.core.step import SeqInput
from engine.core.table_rows import TableRows
from engine.worker import attention_backend
from engine.worker.attention_backend import TorchPagedBackend

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
    # on a CPU the prefills go to the one-call kernel: spans and tables as two int32 matrices
    assert all(p.block_table is None for p in meta.prefills)
    assert meta.prefill_spans.dtype == torch.int32 and meta.prefill_spans.tolist() == [[0, 3, 0], [3, 2, 6]]
    assert meta.prefill_tables.dtype == torch.int32 and meta.prefill_tables.tolist() == [[9, 0], [3, 1]]
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


class _Layer:
    num_heads, num_kv_heads, head_size, scale = 6, 2, 32, 32**-0.5


@pytest.mark.skipif(not ops.prefill_attention_available(), reason="the CPU prefill kernel needs AVX2 and FMA")
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_kernel_matches_the_sdpa_loop(monkeypatch, block_size):
    """A step of: a fresh prompt, a chunk after 13 cached tokens, a 1-token chunk after 30, and
    two decodes; the caches hold the earlier tokens' K/V. Kernel vs the SDPA loop, same caches."""
    gen = torch.Generator().manual_seed(block_size)
    L = _Layer()
    blocks = 64 // block_size * 4
    perm = torch.randperm(blocks, generator=gen).tolist()
    plan = [(17, 0, True), (9, 13, True), (1, 30, True), (1, 20, False), (1, 7, False)]  # tokens, cached
    seqs, taken = [], 0
    for n, cached, prefill in plan:
        used = -(-(n + cached) // block_size)
        seqs.append(SeqInput(list(range(n)), cached, array("i", perm[taken:taken + used]), prefill))
        taken += used
    T = sum(n for n, _, _ in plan)
    meta = TorchPagedBackend(block_size, torch.device("cpu")).build_metadata(seqs)
    assert meta.prefill_spans is not None
    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.randn(blocks, L.num_kv_heads, block_size, L.head_size, generator=gen).to(dtype)
                  for _ in range(2)]
        qkv = torch.randn(T, (L.num_heads + 2 * L.num_kv_heads) * L.head_size, generator=gen).to(dtype)
        q, k, v = qkv.split([L.num_heads * L.head_size, L.num_kv_heads * L.head_size,
                             L.num_kv_heads * L.head_size], dim=-1)
        q, k, v = (t.view(T, -1, L.head_size) for t in (q, k, v))
        got = meta.backend.forward(L, q, k, v, meta, [c.clone() for c in caches])
        monkeypatch.setattr(attention_backend, "_prefill_kernel_applies", lambda q, kc: False)
        want = meta.backend.forward(L, q, k, v, meta, [c.clone() for c in caches])
        monkeypatch.undo()
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel rounds once, SDPA per op
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
