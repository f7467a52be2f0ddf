"""Per-sequence block tables over two `BlockPool`s: the device pool (where attention reads K/V)
and the CPU swap pool. Allocation on demand, copy-on-write, prefix-cache hashes and the device
<-> CPU swap maps. Pure Python bookkeeping, no tensors. The only writer of the KV state: the
tables and each sequence's `SeqKv` record (engine/kv/seq_kv.py: tokens computed, block hashes, the
sibling whose blocks it shares; made at admission or its first prefix-cache lookup, dropped by
`free`). Only the scheduler calls the methods that change it; others read it through the small
read-only ones (`block_table`, `num_computed_tokens`, `usage`, `describe_table`, `block_states`).

A sequence's table lives in exactly one pool (device while it runs, CPU while swapped) and is an
`array('i')` of block ids (`BlockTable`): `block_table` hands out that array itself (no copy),
valid until the next call here. "Does not fit" is a return value (`plan(...).status`, the
`can_*` methods), never an exception.

Prefix caching: engine/kv/prefix_cache.py, over each sequence's chain of full-block hashes.

The device tables are mirrored in `rows` (engine/core/table_rows.py), the matrix the attention
metadata selects the decodes' tables from: tables enter and leave through `_put_table` and
`_pop_table`, and their entries change only in `append_slot` and `_release_out_of_window`.

Layer groups (engine/core/kv_layout.py, `windows`: one per group): a sequence has one table per
group, all of the same length, over the one device pool; `tables`, `cpu_tables` and `rows` are
group 0's (the only group of a model without hybrid windows: today's layout). A windowed group's
blocks that no future query can see (before `first_live_block`) are given back as soon as the
sequence's computed tokens pass them, their entries set to `RELEASED`; copy-on-write, forks and
swaps skip those entries. Prefix caching: group 0's hit takes its chain from block 0 (a windowed
group 0 gives the blocks out of its window back at once); every other group's blocks are hashed
per group and a hit takes them from that group's first live block only, its earlier entries
`RELEASED` from the start (`_group_hits`, engine/kv/prefix_cache.py).
"""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.table_rows import RELEASED, BlockTable, TableRows, new_table
from engine.kv.admission_plan import AdmissionPlan, AllocStatus
from engine.kv.block_pool import Block, BlockPool
from engine.kv.block_swap import BlockSwap
from engine.kv.layer_groups import LayerGroups
from engine.kv.kv_invariants import check_invariants
from engine.core.kv_layout import first_live_block
from engine.kv.kv_usage import KvUsage
from engine.kv.prefix_cache import PrefixCache
from engine.kv.seq_kv import SeqKv

__all__ = ["AdmissionPlan", "AllocStatus", "Block", "BlockManager", "BlockPool", "BlockTable", "KvUsage", "new_table"]

class BlockManager(BlockSwap, LayerGroups):
    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, reserve_tokens: int | None = None, watermark_blocks: int = 0,
                 windows: tuple[int | None, ...] = (None,)):
        """`reserve_tokens`: when set, each sequence gets blocks for that many tokens at admission
        (the contiguous-reservation baseline, for the KV waste study) instead of on demand.
        `windows`: each layer group's sliding window (`KvLayout.windows`; None: full attention)."""
        assert windows, "at least one layer group"
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_tokens = reserve_tokens
        self.watermark_blocks = watermark_blocks
        self.windows = tuple(windows)
        self.windowed = [k for k, w in enumerate(self.windows) if w is not None]  # groups that give blocks back
        # per group: seq_id -> device block ids, seq_id -> swap-pool block ids, the device tables as rows
        self.group_tables: list[dict[int, BlockTable]] = [{} for _ in self.windows]
        self.group_cpu_tables: list[dict[int, BlockTable]] = [{} for _ in self.windows]
        self.group_rows = [TableRows() for _ in self.windows]
        self._rows_of = {id(t): r for t, r in zip(self.group_tables, self.group_rows)}
        self.tables, self.cpu_tables, self.rows = self.group_tables[0], self.group_cpu_tables[0], self.group_rows[0]
        self.prefix = PrefixCache(self.device, block_size, enable_prefix_caching)
        self.kv: dict[int, SeqKv] = {}  # seq_id -> its record (engine/kv/seq_kv.py)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    # ---------------------------------------------------------------- queries
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_groups(self) -> int:
        """Layer groups: the tables each sequence has (a slot for its next token takes at most
        one block in each)."""
        return len(self.windows)

    def block_table(self, seq: Sequence, group: int = 0) -> BlockTable:
        """The sequence's device block ids in layer group `group`: the live array (do not modify
        it; a windowed group's entries before its first live block are `RELEASED`)."""
        return self.group_tables[group][seq.seq_id]

    def num_computed_tokens(self, seq: Sequence) -> int:
        """The sequence's leading tokens whose K/V are in the cache (0 if it holds no blocks)."""
        kv = self.kv.get(seq.seq_id)
        return kv.num_computed_tokens if kv is not None else 0

    def num_uncomputed_tokens(self, seq: Sequence) -> int:
        return len(seq) - self.num_computed_tokens(seq)

    def pending_share(self, seq: Sequence) -> tuple[Sequence, int] | None:
        """(the sibling, the tokens) while `seq` shares prompt blocks that a sibling admitted
        with it has yet to compute (`SeqKv.waits_for`); None once computed, or if it shares none."""
        kv = self.kv.get(seq.seq_id)
        wait = kv.waits_for if kv is not None else None
        if wait is None or wait[1].num_computed_tokens >= wait[2]:
            return None
        return wait[0], wait[2]

    def _table_len(self, num_tokens: int) -> int:
        """Entries of each of a sequence's tables at admission."""
        return self.num_blocks_for(max(num_tokens, self.reserve_tokens or 0))

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Device blocks a sequence of `num_tokens` tokens holds at admission (every group's)."""
        return self.num_groups * self._table_len(num_tokens)

    def describe_table(self, seq: Sequence) -> tuple[str | None, list[int], list[int]]:
        """(pool: "device", "cpu" or None, its group-0 block ids, their ref counts; 0 for a
        `RELEASED` entry): a copy, for views."""
        for name, pool, tables in (("device", self.device, self.tables), ("cpu", self.cpu, self.cpu_tables)):
            if seq.seq_id in tables:
                table = tables[seq.seq_id]
                return name, list(table), [pool.blocks[i].ref_count if i >= 0 else 0 for i in table]
        return None, [], []

    def num_slots(self, seq: Sequence) -> int:
        """Token slots of the sequence's device blocks (0 if it has none there)."""
        return len(self.tables.get(seq.seq_id, ())) * self.block_size

    def take_table_changes(self) -> list[tuple]:
        """Group 0's device tables' changes since the last call (`TableRows.take_changes`).
        NOTE: the other groups' logs are dropped: no worker mirrors them yet (a hybrid layout
        runs on one rank, engine/worker/tp_worker.py refuses it)."""
        for rows in self.group_rows[1:]:
            rows.take_changes()
        return self.rows.take_changes()

    @property
    def num_free_device_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    # ---------------------------------------------------------------- admission
    def _num_shared_prompt_blocks(self, group: SequenceGroup, seqs: list[Sequence]) -> int:
        """Full prompt blocks that sequences admitted together share (the samples of one prompt
        being recomputed): each still computes at least its last token itself."""
        if len(seqs) < 2:
            return 0
        return min([len(group.prompt_token_ids) // self.block_size] + [(len(s) - 1) // self.block_size for s in seqs])

    def _kv(self, seq: Sequence) -> SeqKv:
        kv = self.kv.get(seq.seq_id)
        if kv is None:
            kv = self.kv[seq.seq_id] = SeqKv()
        return kv

    def plan(self, group: SequenceGroup, seqs: list[Sequence] | None = None, reserve: int = 0) -> AdmissionPlan:
        """What admitting `seqs` (default: the group's waiting sequences) now takes, and whether
        it fits leaving `reserve` blocks free. Prefix-cache hits on blocks that are in use
        (live) take no free block. Mutates nothing but the first sequence's hash chain (its
        record is made here if it has none: the chain is kept for its admission)."""
        seqs = group.seqs_with_status(SequenceStatus.WAITING) if seqs is None else seqs
        plan = AdmissionPlan(AllocStatus.OK, seqs, num_shared=self._num_shared_prompt_blocks(group, seqs))
        num_blocks, G = 0, self.num_groups
        for idx, seq in enumerate(seqs):
            n_blocks = self.blocks_to_hold(len(seq))  # every group's
            if idx == 0:
                plan.hits = self.prefix.hits(group, seq, self._kv(seq))
                # NOTE: keep at least one token to compute, so the step yields logits.
                reused = min(len(plan.hits), (len(seq) - 1) // self.block_size)
                if G > 1 and reused:
                    # NOTE: siblings sharing its first blocks need every group's blocks from
                    # their own first live block on, which is no earlier than the first one's
                    # when it reuses no more than they share.
                    reused = min(reused, plan.num_shared or reused)
                    reused, plan.group_hits = self._group_hits(seq, reused)
                plan.num_reused = reused
                # claimed, not taken; and the other groups' entries before their windows take none
                live = sum(1 for hits in [plan.hits[:reused], *plan.group_hits] for b in hits if b.ref_count > 0)
                live += sum(first_live_block(reused * self.block_size, w, self.block_size) for w in self.windows[1:])
            elif plan.num_shared:
                reused = live = plan.num_shared  # references on the first sequence's blocks
                live *= G  # (in every group)
            else:
                # NOTE: the first sequence's allocation may evict what this one would find now,
                # so count no hits: an upper bound on its blocks and tokens.
                reused = live = 0
            num_blocks += n_blocks - (G * reused if idx > 0 else 0)
            plan.num_free_needed += n_blocks - live
            plan.num_new_tokens += len(seq) - reused * self.block_size
        if num_blocks > self.device.num_blocks - self.watermark_blocks:
            plan.status = AllocStatus.NEVER
        elif plan.num_free_needed + reserve > self.device.num_free - self.watermark_blocks:
            plan.status = AllocStatus.LATER
        return plan

    def can_allocate(self, group: SequenceGroup, seqs: list[Sequence] | None = None, reserve: int = 0) -> AllocStatus:
        return self.plan(group, seqs, reserve).status

    def num_tokens_to_compute(self, group: SequenceGroup, seqs: list[Sequence] | None = None) -> int:
        """Tokens `seqs` would compute if allocated now (after `allocate`, the sum of their
        `num_uncomputed_tokens`, at most this). Mutates nothing."""
        return self.plan(group, seqs).num_new_tokens

    def allocate(self, group: SequenceGroup, seqs: list[Sequence] | None = None, register: bool = True,
                 plan: AdmissionPlan | None = None) -> None:
        """Carry out `plan` (default: plan `seqs` now; its status must be OK): give each
        sequence a block table covering its tokens, reusing cached prefix blocks, and set
        `num_computed_tokens` to the reused length. Sequences admitted together share the first
        one's full prompt blocks and wait for it to compute them (`pending_share`). `register`: publish the new full
        blocks' hashes now, as the step computes all of them; False when it may compute only
        part of them, whose blocks are registered once computed (`register_full_blocks`)."""
        plan = plan or self.plan(group, seqs)
        assert plan.status is AllocStatus.OK
        pool, bs, first = self.device, self.block_size, []
        for idx, seq in enumerate(plan.seqs):
            assert seq.seq_id not in self.tables
            kv = self._kv(seq)
            kv.waits_for = None
            if idx > 0 and plan.num_shared:
                kv.waits_for = (plan.seqs[0], self.kv[plan.seqs[0].seq_id], plan.num_shared * bs)
            tables = [self._admission_table(group, plan, idx, k, first) for k in range(self.num_groups)]
            table = tables[0]
            kv.num_registered_blocks = len(table)  # reused blocks are registered already
            kv.num_computed_tokens = len(table) * bs
            for k, t in enumerate(tables):
                while len(t) < self._table_len(len(seq)):
                    t.append(pool.allocate().block_id)
                self._put_table(self.group_tables[k], seq.seq_id, t)
            if idx == 0:
                first = tables
            if register:
                self.prefix.publish(seq, kv, tables, group.params.cache_salt, len(seq) // bs)
        if self.windowed:
            # NOTE: after every table is made: a sibling takes references on the first
            # sequence's shared blocks, which may lie before the first one's window.
            for seq in plan.seqs:
                self._release_out_of_window(seq.seq_id, self.kv[seq.seq_id])

    def mark_computed(self, seq: Sequence, num_tokens: int, salt: str | None) -> None:
        """A step computed the sequence's next `num_tokens` tokens: advance `num_computed_tokens`
        and, with prefix caching, publish its newly full blocks (of its prompt or of generated
        text: chat history can be reused by later requests too). It no longer waits for a
        sibling (that one computed the shared blocks in this step at the latest)."""
        kv = self.kv[seq.seq_id]
        kv.num_computed_tokens += num_tokens
        kv.waits_for = None
        n = kv.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and n > kv.num_registered_blocks:  # NOTE: per step, for every sequence
            self.prefix.publish(seq, kv, self._tables_of(seq.seq_id), salt, n)
        if self.windowed:  # NOTE: after publishing: a block given back keeps its hash, cached
            self._release_out_of_window(seq.seq_id, kv)

    def mark_all_computed(self, scheduled) -> None:
        """`mark_computed` for every ScheduledSeq of a step that ran (its `num_tokens`, its
        request's cache salt)."""
        # NOTE: one call per step with the loop's lookups hoisted: it runs for every running
        # sequence every step, where a call per sequence cost ~1.5 us of host time each.
        kvs, bs, caching = self.kv, self.block_size, self.enable_prefix_caching
        windowed = bool(self.windowed)
        for s in scheduled:
            seq = s.seq
            kv = kvs[seq.seq_id]
            kv.num_computed_tokens += s.num_tokens
            kv.waits_for = None
            if caching:
                n = kv.num_computed_tokens // bs
                if n > kv.num_registered_blocks:
                    self.prefix.publish(seq, kv, self._tables_of(seq.seq_id), s.group.params.cache_salt, n)
            if windowed:
                self._release_out_of_window(seq.seq_id, kv)

    # ---------------------------------------------------------------- decoding
    def _num_append_blocks(self, seqs: list[Sequence], tables: dict[int, BlockTable], pool: BlockPool,
                           refs=None) -> int:
        """Free blocks that `append_slot` on each of `seqs` in turn would take: one for each
        sequence whose last block is full, and a copy for each writer into a shared last block
        except the last writer when no one else holds it. `refs(block id)` gives the reference
        count to use (default: the block's own)."""
        refs = refs or (lambda i: pool.blocks[i].ref_count)
        need = 0
        writers: dict[int, int] = {}  # shared last block id -> writers
        for s in seqs:
            table = tables[s.seq_id]
            if len(table) * self.block_size < len(s):
                need += 1
                continue
            last = table[self.num_blocks_for(len(s)) - 1]
            if refs(last) > 1:
                writers[last] = writers.get(last, 0) + 1
        for block_id, m in writers.items():
            need += m if refs(block_id) > m else m - 1
        return need

    def num_append_blocks(self, seqs: list[Sequence]) -> int:
        """Free device blocks that giving each of `seqs` (running) a slot for its next token takes."""
        return sum(self._num_append_blocks(seqs, tables, self.device) for tables in self.group_tables)

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get a slot for its next token."""
        return self.num_append_blocks(group.seqs_with_status(SequenceStatus.RUNNING)) <= self.device.num_free

    def append_slot(self, seq: Sequence) -> tuple[tuple[int, int], ...] | None:
        """Make sure the slot of the sequence's last token exists and is private in every group.
        Returns the (src, dst) copy-on-write pairs (group 0's first) when shared blocks had to
        be copied, else None."""
        if len(self.group_tables) == 1:  # NOTE: the common case, for every decode at every step
            pair = self._append_slot(self.tables, self.rows, seq.seq_id, len(seq))
            return None if pair is None else (pair,)
        pairs = [self._append_slot(t, r, seq.seq_id, len(seq)) for t, r in zip(self.group_tables, self.group_rows)]
        pairs = tuple(p for p in pairs if p is not None)
        return pairs or None

    def _append_slot(self, tables: dict[int, BlockTable], rows: TableRows, seq_id: int, n: int) -> tuple[int, int] | None:
        table, pool = tables[seq_id], self.device
        if len(table) * self.block_size < n:
            table.append(pool.allocate().block_id)
            rows.set(seq_id, len(table) - 1, table[-1])
            return None
        idx = (n - 1) // self.block_size  # the last token's block
        last = pool.blocks[table[idx]]
        if last.ref_count == 1:
            return None
        new = pool.allocate()
        table[idx] = new.block_id
        rows.set(seq_id, idx, new.block_id)
        pool.release(last)
        return last.block_id, new.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child (same tokens so far) shares all of the parent's blocks in every group (ref
        counts go up; nothing is copied) and starts from its record: computed tokens, hashes."""
        kv = self.kv[parent.seq_id]
        for tables in self.group_tables:
            table = tables[parent.seq_id]
            for i in table:
                if i != RELEASED:
                    self.device.ref(self.device.blocks[i])
            self._put_table(tables, child.seq_id, table[:])
        self.kv[child.seq_id] = SeqKv(kv.num_computed_tokens, list(kv.block_hashes), kv.num_registered_blocks)

    def free(self, seq: Sequence) -> None:
        """Forget the sequence (finished, dropped, aborted): drop its references, device or swap
        pool, and its record. A no-op if it holds none."""
        self._release(seq)
        self.kv.pop(seq.seq_id, None)

    def free_to_recompute(self, seq: Sequence) -> None:
        """Drop the sequence's references (preempted or parked: it is computed again from its
        tokens): `num_computed_tokens` 0, no sibling to wait for; its hash chain is kept (the
        same tokens hash the same)."""
        self._release(seq)
        kv = self.kv.get(seq.seq_id)
        if kv is not None:
            kv.num_computed_tokens = kv.num_registered_blocks = 0
            kv.waits_for = None

    def _release(self, seq: Sequence) -> None:
        for pool, group_tables in ((self.device, self.group_tables), (self.cpu, self.group_cpu_tables)):
            for tables in group_tables:
                for i in reversed(self._pop_table(tables, seq.seq_id)):
                    if i != RELEASED:
                        pool.release(pool.blocks[i])

    def _put_table(self, tables: dict[int, BlockTable], seq_id: int, table: BlockTable) -> None:
        tables[seq_id] = table
        rows = self._rows_of.get(id(tables))  # a device group's (None: a swap pool's)
        if rows is not None:
            rows.assign(seq_id, table)

    def _pop_table(self, tables: dict[int, BlockTable], seq_id: int) -> BlockTable:
        """The sequence's table, taken out of `tables` (empty if it has none there)."""
        table = tables.pop(seq_id, None)
        if table is None:
            return new_table()
        rows = self._rows_of.get(id(tables))
        if rows is not None:
            rows.release(seq_id, len(table))
        return table

    # ---------------------------------------------------------------- checks and views
    def reset(self) -> None:
        """Both pools and the counters as after construction; only when no sequence holds a
        block (the engine's start-up calibration runs real requests, then forgets them)."""
        assert not any(self.group_tables) and not any(self.group_cpu_tables), "reset of a block manager with sequences"
        self.device.reset()
        self.cpu.reset()
        self.kv.clear()
        self.prefix_queries = self.prefix_hits = self.prefix.num_hashes = 0

    def check_integrity(self) -> None:
        """Assert the pool invariants (engine/kv/kv_invariants.py); the tests call it after every step."""
        check_invariants(self)

    def all_free(self) -> bool:
        """No table, no record, every block free: nothing leaked once every request is done."""
        return (not any(self.group_tables) and not any(self.group_cpu_tables) and not self.kv
                and self.device.num_free == self.device.num_blocks and self.cpu.num_free == self.cpu.num_blocks)

    def usage(self) -> KvUsage:
        """The pools' counters, for metrics, in O(1)."""
        d, c = self.device, self.cpu
        return KvUsage(d.num_blocks, d.num_free, c.num_blocks, c.num_free, d.num_used, c.num_used, d.num_shared,
                       d.saved_by_sharing, self.prefix_queries, self.prefix_hits)

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """Per device block: 0 free, 1 used, 2 shared, 3 cached; ref counts; per CPU block:
        0 free, 4 swapped. O(pool): built on demand (the dashboard), never per step."""
        states = [2 if b.ref_count > 1 else 1 if b.ref_count else 3 if b.hash is not None else 0
                  for b in self.device.blocks]
        cpu = [4 if b.ref_count else 0 for b in self.cpu.blocks]
        return states, [b.ref_count for b in self.device.blocks], cpu
