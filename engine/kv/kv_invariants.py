"""The block manager's invariants, asserted (`BlockManager.check_integrity`, which every
scheduler and engine test calls after each step). Reads its tables, pools and records; changes
nothing. Kept apart from the block manager: it is the tests' contract on it, not bookkeeping."""

from __future__ import annotations

from engine.core.table_rows import RELEASED
from engine.core.kv_layout import first_live_block


def check_invariants(bm) -> None:
    """Assert, for a `BlockManager` `bm`: free + cached + used == total in each pool, every ref
    count equals the number of table entries holding the block over every layer group, the usage
    counters agree, each group's table rows mirror its device tables, every sequence holding a
    table has its record (`SeqKv`), with no more tokens computed than its device blocks hold, a
    table of the same length in every group, and exactly the blocks before a windowed group's
    first live block given back (`RELEASED`; none in a group without a window)."""
    for pool, group_tables in ((bm.device, bm.group_tables), (bm.cpu, bm.group_cpu_tables)):
        refs = [0] * pool.num_blocks
        for tables in group_tables:
            for table in tables.values():
                for i in table:
                    if i != RELEASED:
                        refs[i] += 1
        for b in pool.blocks:
            assert b.ref_count == refs[b.block_id], f"{b} held by {refs[b.block_id]} tables"
        free, cached = set(pool.free), set(pool.cached)
        assert len(free) == len(pool.free), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached"
        for i in free | cached:
            assert pool.blocks[i].ref_count == 0, f"{pool.blocks[i]} is free but referenced"
        used = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert used + len(free) + len(cached) == pool.num_blocks, "a block is lost"
        assert (pool.num_used, pool.num_refs) == (used, sum(refs)), "usage counters drifted"
        assert pool.num_shared == sum(1 for b in pool.blocks if b.ref_count > 1), "shared counter drifted"
        for h, i in pool.by_hash.items():
            assert pool.blocks[i].hash == h
        for k, tables in enumerate(group_tables):
            assert tables.keys() == group_tables[0].keys(), f"group {k} holds other sequences than group 0"
            for seq_id, table in tables.items():
                assert seq_id in bm.kv, f"sequence {seq_id} holds a table but has no KV record"
                assert len(table) == len(group_tables[0][seq_id]), f"sequence {seq_id}: tables of unequal length"
                dead = first_live_block(bm.kv[seq_id].num_computed_tokens, bm.windows[k], bm.block_size)
                assert all(i == RELEASED for i in table[:dead]), f"sequence {seq_id} holds blocks out of its window"
                assert RELEASED not in table[dead:], f"sequence {seq_id} gave back a block its window reaches"
    for seq_id, table in bm.tables.items():
        kv = bm.kv[seq_id]
        assert kv.num_computed_tokens <= len(table) * bm.block_size, f"sequence {seq_id} computed past its blocks"
        assert kv.num_registered_blocks <= len(table), f"sequence {seq_id} published blocks it does not hold"
    for rows, tables in zip(bm.group_rows, bm.group_tables):
        rows.check(tables)
