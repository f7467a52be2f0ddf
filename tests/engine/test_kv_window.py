"""Sliding-window layer groups (engine/core/kv_layout.py) in the block manager: the layout a model
gets, the blocks a windowed group gives back, and CoW, forks, swaps and prefix hits with them.
No model, no tensors (the liveness walk with windows: tests/engine/test_liveness.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.core.sequence import SequenceStatus
from engine.core.table_rows import RELEASED
from engine.kv.block_manager import BlockManager
from engine.core.kv_layout import KvGroup, first_live_block, kv_layout
from engine.worker.models.llama import layer_sliding_window
from engine.worker.window_attention import first_block
from tests.engine.test_block_manager import admit, make_group

GEMMA3_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]


def windows_of(types, window=512):
    config = SimpleNamespace(sliding_window=window, layer_types=types)
    return [layer_sliding_window(config, i) for i in range(len(types))]


def test_layouts_of_plain_uniform_and_hybrid_models():
    assert kv_layout([None] * 4).groups == (KvGroup(None, (0, 1, 2, 3)),)  # today's layout
    assert kv_layout([64] * 4).groups == (KvGroup(64, (0, 1, 2, 3)),)  # Mistral: one windowed group
    assert kv_layout([64, None] * 2, free_windows=False).groups == (KvGroup(None, (0, 1, 2, 3)),)
    gemma2 = kv_layout([4096, None] * 13)  # alternating: two groups of 13
    assert gemma2.slots == 13 and gemma2.windows == (None, 4096)
    gemma3 = kv_layout(windows_of(GEMMA3_TYPES))  # 4 full + 22 windowed layers: 7 groups of 4
    assert gemma3.slots == 4 and gemma3.windows == (None,) + (512,) * 6
    assert gemma3.groups[0].layers == (5, 11, 17, 23) and gemma3.groups[-1].layers == (24, 25)  # padded
    assert sorted(i for g in gemma3.groups for i in g.layers) == list(range(26))
    assert gemma3.place(23) == (0, 3) and gemma3.place(0) == (1, 0)


def test_released_blocks_are_exactly_those_the_attention_does_not_read():
    for window in (1, 3, 16, 17, 100):
        for bs in (1, 4, 16):
            for n in range(0, 300, 7):
                assert first_live_block(n, window, bs) == first_block(n, window, bs)


def test_a_long_sequence_keeps_only_its_window_in_windowed_groups():
    bs, window = 16, 512
    windows = (None,) + (window,) * 6
    bm = BlockManager(7 * 600, 0, bs, windows=windows)
    g = make_group(8192)
    assert bm.plan(g).num_free_needed == 7 * 512  # the prompt's step writes every group's K/V
    admit(bm, g)  # (and computes it)
    seq = g.seqs[0]
    bm.check_integrity()
    live = 512 - (8192 - window + 1) // bs  # 32: the blocks holding positions > 8192 - 512
    assert bm.num_live_blocks(seq) == 512 + 6 * live
    for _ in range(200):  # decoding: the window slides, each group holds at most W/bs + 1 blocks
        seq.output_token_ids.append(1)
        assert bm.append_slot(seq) is None
        bm.mark_computed(seq, 1, None)
        for k in range(1, 7):
            table = bm.block_table(seq, k)
            assert len(table) - table.count(RELEASED) <= window // bs + 1
    bm.check_integrity()
    bm.free(seq)
    assert bm.all_free()


@pytest.mark.parametrize("windows", [(8,), (None, 8, 8)])
def test_fork_cow_and_swap_keep_released_entries_and_counts(windows):
    bm = BlockManager(60, 60, 4, windows=windows)
    g = make_group(30, n=2, best_of=2)
    admit(bm, g)
    parent = g.seqs[0]
    child = parent.fork(1, None)
    bm.fork(parent, child)
    g.seqs.append(child)
    bm.check_integrity()
    assert bm.block_table(child, len(windows) - 1)[0] == RELEASED
    for seq in (parent, child):  # both write into the shared last block: one copy per group
        seq.output_token_ids.append(5)
        cow = bm.append_slot(seq)
        bm.mark_computed(seq, 1, None)
        if seq is parent:
            assert cow is not None and len(cow) == len(windows)
    bm.check_integrity()
    before = [list(bm.block_table(child, k)) for k in range(len(windows))]
    assert bm.can_swap_out(g) and bm.fits_pool_after_swap(g)
    out = bm.swap_out(g)
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    bm.check_integrity()
    held = {i for s in g.seqs for t in bm.group_cpu_tables for i in t[s.seq_id]}
    assert len(out) == len(held - {RELEASED})  # each live block once, shared ones too
    assert bm.can_swap_in(g)
    bm.swap_in(g)
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    bm.check_integrity()
    after = [list(bm.block_table(child, k)) for k in range(len(windows))]
    assert [[i == RELEASED for i in t] for t in after] == [[i == RELEASED for i in t] for t in before]
    for s in g.seqs:
        bm.free(s)
    assert bm.all_free()


def test_prefix_hits_on_a_windowed_group_give_back_what_is_out_of_the_window():
    bm = BlockManager(40, 0, 4, enable_prefix_caching=True, windows=(8,))
    a = make_group(40, "a")
    admit(bm, a)
    assert bm.device.num_free == 40 - 2  # blocks 0..7 given back (cached, evictable), 8 and 9 kept
    bm.check_integrity()
    b = make_group(40, "b")  # the same prompt: a hit on every full block but the last
    bm.allocate(b)
    seq = b.seqs[0]
    assert bm.num_computed_tokens(seq) == 36
    assert list(bm.block_table(seq)[:first_live_block(36, 8, 4)]) == [RELEASED] * 7
    assert bm.usage().prefix_hits == 36
    bm.check_integrity()
    for g in (a, b):
        bm.free(g.seqs[0])
    assert bm.all_free()


def test_hybrid_prefix_hits_take_each_group_from_its_window_and_shorten_on_a_miss():
    bs, windows = 4, (None, 8)
    bm = BlockManager(60, 0, bs, enable_prefix_caching=True, windows=windows)
    a = make_group(40, "a")
    admit(bm, a)  # computes 40 tokens: group 1 keeps blocks 8, 9
    bm.free(a.seqs[0])  # every block cached (evictable), each group's under its own hash
    b = make_group(40, "b")
    bm.allocate(b)
    seq = b.seqs[0]
    assert bm.num_computed_tokens(seq) == 36  # 9 blocks: group 0's 0..8, group 1's 7..8 (its window)
    full, windowed = bm.block_table(seq, 0), bm.block_table(seq, 1)
    assert list(windowed[:7]) == [RELEASED] * 7 and len(full) == len(windowed) == 10
    for k, table in ((0, full), (1, windowed)):
        for i in range(first_live_block(36, windows[k], bs), 9):  # the hits hold these tokens
            assert bm.device.blocks[table[i]].token_ids == tuple(seq.prompt_token_ids[i * bs:(i + 1) * bs])
    assert not set(full[:9]) & set(windowed[7:9])  # the same tokens, other layers: other blocks
    bm.check_integrity()
    bm.free(seq)
    # group 1's block 8 evicted: a hit of 9 blocks lacks it, so the hit shortens to 8 blocks
    # (group 1's 6..7 were given back by a at 40 tokens but are still cached)
    evicted = next(blk for blk in bm.device.blocks if blk.block_id == windowed[8])
    bm.device.cached.move_to_end(evicted.block_id, last=False)
    held = [bm.device.allocate() for _ in range(len(bm.device.free) + 1)]  # the free list, then that block
    assert evicted.hash is None
    c = make_group(40, "c")
    bm.allocate(c)
    assert bm.num_computed_tokens(c.seqs[0]) == 32
    assert list(bm.block_table(c.seqs[0], 1)[:first_live_block(32, 8, bs)]) == [RELEASED] * 6
    for blk in held:
        bm.device.release(blk)
    bm.check_integrity()
    bm.free(c.seqs[0])
    assert bm.all_free()
