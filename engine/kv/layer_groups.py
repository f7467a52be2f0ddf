"""`LayerGroups`: the block manager's work across KV layer groups (engine/core/kv_layout.py): the
other groups' tables, giving back the blocks that fall out of a windowed group's window, and each
group's table at admission (a sibling's shared blocks, a prefix-cache hit's blocks in every group). A base class of `BlockManager`
(engine/kv/block_manager.py), kept in a file of its own: the same owner of blocks and tables (its
methods use the manager's pool, tables, rows and records). Nothing here is called from outside
the block manager but the read-only `group_block_tables`, `num_live_blocks`, `num_table_entries`.
"""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup
from engine.core.table_rows import RELEASED, BlockTable, new_table
from engine.kv.admission_plan import AdmissionPlan
from engine.kv.block_pool import Block
from engine.core.kv_layout import first_live_block
from engine.kv.seq_kv import SeqKv


class LayerGroups:
    def group_block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        """The sequence's device tables of layer groups 1.. (live arrays, as `block_table`); ()
        with one group."""
        if len(self.group_tables) == 1:  # NOTE: the common case, for every scheduled sequence
            return ()
        return tuple(tables[seq.seq_id] for tables in self.group_tables[1:])

    def num_table_entries(self) -> int:
        """Live entries of all device tables: the blocks they would take unshared (O(sequences))."""
        if not self.windowed:
            return sum(len(t) for tables in self.group_tables for t in tables.values())
        return sum(len(t) - t.count(RELEASED) for tables in self.group_tables for t in tables.values())

    def num_live_blocks(self, seq: Sequence) -> int:
        """Device blocks (table entries not `RELEASED`) the sequence holds over all its groups."""
        return sum(len(t[seq.seq_id]) - t[seq.seq_id].count(RELEASED) for t in self.group_tables
                   if seq.seq_id in t)

    def _group_hits(self, seq: Sequence, reused: int) -> tuple[int, list[list[Block]]]:
        """The most blocks m <= `reused` (group 0's hits) for which every other layer group has
        its blocks from its first live block to m cached, and those blocks (groups 1..)."""
        kv, bs, m = self.kv[seq.seq_id], self.block_size, reused
        while m > 0:
            found = []
            for k in range(1, self.num_groups):
                blocks, missing = self.prefix.group_blocks(seq, kv, k, first_live_block(m * bs, self.windows[k], bs), m)
                if missing >= 0:
                    # NOTE: a smaller m whose range holds `missing` fails too, and a range's first
                    # block only moves down as m does: the next candidate is m = missing.
                    m = missing
                    break
                found.append(blocks)
            else:
                return m, found
        return 0, []

    def _release_out_of_window(self, seq_id: int, kv: SeqKv) -> None:
        """Give back the device blocks of the sequence's windowed groups that no future query
        sees (`first_live_block` of its computed tokens), back to front until an entry given
        back before: O(blocks given back). A block with a prefix-cache hash stays cached."""
        pool, bs, n = self.device, self.block_size, kv.num_computed_tokens
        for k in self.windowed:
            tables = self.group_tables[k]
            table, rows = tables[seq_id], self._rows_of[id(tables)]
            i = first_live_block(n, self.windows[k], bs) - 1
            while i >= 0 and table[i] != RELEASED:
                pool.release(pool.blocks[table[i]])
                table[i] = RELEASED
                rows.set(seq_id, i, RELEASED)
                i -= 1

    def _tables_of(self, seq_id: int) -> list[BlockTable]:
        """The sequence's device table in each layer group."""
        return [tables[seq_id] for tables in self.group_tables]

    def _admission_table(self, group: SequenceGroup, plan: AdmissionPlan, idx: int, k: int,
                         first: list[BlockTable]) -> BlockTable:
        """The leading entries of the `idx`-th planned sequence's group-`k` table at admission:
        the first sequence's shared prompt blocks, its prefix-cache hits (group 0 of a one-group
        layout), or none. References taken."""
        pool, seq = self.device, plan.seqs[idx]
        table = new_table()
        if idx > 0 and plan.num_shared:
            # NOTE: the first sequence computes these blocks in this same step; every layer
            # writes all K/V of the step before attending, so the others can read them.
            table = first[k][: plan.num_shared]
            for i in table:
                if i != RELEASED:  # (the first one's prefix-cache hit skips blocks out of a window)
                    pool.ref(pool.blocks[i])
        elif idx == 0 and k > 0 and plan.group_hits:
            lo = first_live_block(plan.num_reused * self.block_size, self.windows[k], self.block_size)
            for b in plan.group_hits[k - 1]:
                assert b.hash is not None, "a planned hit was evicted"
                pool.ref(b)
            table = new_table([RELEASED] * lo + [b.block_id for b in plan.group_hits[k - 1]])
        elif idx == 0 and k == 0 and self.prefix.cacheable_blocks(group, seq):
            self.prefix_queries += len(seq)
            for b in plan.hits:
                assert b.hash is not None, "a planned hit was evicted"
                pool.ref(b)
            table = new_table(b.block_id for b in plan.hits[: plan.num_reused])
            for b in plan.hits[plan.num_reused:]:  # all of it cached: the last block is recomputed
                pool.release(b)  # (if unreferenced, it is cached again, most recent)
            self.prefix_hits += len(table) * self.block_size
        return table
