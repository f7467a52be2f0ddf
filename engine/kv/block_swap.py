"""`BlockSwap`: the block manager's device <-> CPU swap of its sequences' tables, every layer
group's. A base class of `BlockManager` (engine/kv/block_manager.py), kept in a file of its own:
the same owner of the blocks and tables (its methods use the manager's pools, tables and
`_put_table` / `_pop_table`), one responsibility per file. Only the scheduler calls the
mutating ones (`swap_out`, `swap_in`)."""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.table_rows import RELEASED, BlockTable, new_table
from engine.kv.block_pool import Block, BlockPool


class BlockSwap:
    # NOTE: every group's live blocks move; `RELEASED` entries stay `RELEASED` (nothing to copy).
    def can_swap_out(self, group: SequenceGroup) -> bool:
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        live = {i for tables in self.group_tables for s in seqs for i in tables[s.seq_id]}
        return len(live - {RELEASED}) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to the swap pool; a block shared inside the group
        is copied once and stays shared. Returns (device block, cpu block) pairs to copy."""
        return self._move(group, SequenceStatus.RUNNING, self.group_tables, self.device, self.group_cpu_tables,
                          self.cpu)

    def _swap_in_need(self, seqs: list[Sequence], group_tables: list[dict[int, BlockTable]], pool: BlockPool) -> int:
        """Device blocks `seqs` take once swapped in and given their next slots: one per distinct
        block of their tables, plus `_num_append_blocks` with the sharing inside the group only
        (swapping copies a block shared with other requests)."""
        local: dict[int, int] = {}
        for tables in group_tables:
            for s in seqs:
                for i in tables[s.seq_id]:
                    local[i] = local.get(i, 0) + 1
        num_live = len(local) - (RELEASED in local)
        return num_live + sum(self._num_append_blocks(seqs, tables, pool, local.__getitem__)
                              for tables in group_tables)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        needed = self._swap_in_need(group.seqs_with_status(SequenceStatus.SWAPPED), self.group_cpu_tables, self.cpu)
        return needed <= self.device.num_free - self.watermark_blocks

    def fits_pool_after_swap(self, group: SequenceGroup) -> bool:
        """Whether the group's running sequences, once swapped out, could come back: what they
        would take at swap-in is at most the whole device pool. Mutates nothing."""
        needed = self._swap_in_need(group.seqs_with_status(SequenceStatus.RUNNING), self.group_tables, self.device)
        return needed <= self.device.num_blocks - self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Inverse of swap_out. Returns (cpu block, device block) pairs to copy."""
        return self._move(group, SequenceStatus.SWAPPED, self.group_cpu_tables, self.cpu, self.group_tables,
                          self.device)

    def _move(self, group, status, src_groups, src_pool, dst_groups, dst_pool) -> list[tuple[int, int]]:
        mapping: dict[int, Block] = {}
        for seq in group.seqs_with_status(status):
            for src_tables, dst_tables in zip(src_groups, dst_groups):
                moved = new_table()
                for i in self._pop_table(src_tables, seq.seq_id):
                    if i == RELEASED:
                        moved.append(RELEASED)
                        continue
                    if i in mapping:
                        dst_pool.ref(mapping[i])
                    else:
                        mapping[i] = dst_pool.allocate()
                    moved.append(mapping[i].block_id)
                    src_pool.release(src_pool.blocks[i])
                self._put_table(dst_tables, seq.seq_id, moved)
            self.kv[seq.seq_id].num_registered_blocks = 0  # blocks new to the pool carry no hash yet
        return [(src, dst.block_id) for src, dst in mapping.items()]
