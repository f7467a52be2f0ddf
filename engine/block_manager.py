"""The KV block pool: free lists, reference counts, per-sequence block tables, copy-on-write,
prefix-cache hashes and the device <-> CPU swap maps. Pure Python bookkeeping, no tensors.

Two pools share one `BlockPool` class: the device pool (where attention reads K/V) and the CPU
swap pool. A sequence's table lives in exactly one of them (device while it runs, CPU while
swapped). "Does not fit" is a return value (`can_*` methods), never an exception.

Free-list order (a tested contract): blocks are handed out lowest id first from a fresh pool;
freed blocks go to the back of the free list (FIFO). With prefix caching, a freed block that
holds a full, hashed block of tokens is kept as "cached" instead: it can be claimed again by
hash, and is evicted (its hash dropped) only when the free list is empty, least recently
freed first.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.sequence import Sequence, SequenceGroup, SequenceStatus


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # prefix-cache identity; set once while allocated
        self.token_ids: tuple[int, ...] | None = None  # the tokens behind `hash`, to check hits

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash is not None})"


class BlockPool:
    """Fixed set of blocks with a FIFO free list and, optionally, an LRU set of cached blocks."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hash kept; oldest first
        self.by_hash: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: free plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> Block:
        """A block with ref count 1. Callers check `num_free` first."""
        if self.free:
            block = self.blocks[self.free.popleft()]
        else:
            block_id, _ = self.cached.popitem(last=False)  # evict the least recently freed
            block = self.blocks[block_id]
            del self.by_hash[block.hash]
            block.hash, block.token_ids = None, None
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> Block | None:
        """The block registered under hash `h` if its tokens match, live (referenced) or
        cached; None on a miss. Mutates nothing."""
        block_id = self.by_hash.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids:  # a hash collision: treat as a miss
            return None
        return block

    def claim(self, block: Block) -> None:
        """Take a reference on a block found by `lookup` (a cached one leaves the cached set)."""
        if block.ref_count == 0:
            del self.cached[block.block_id]
        block.ref_count += 1

    def set_hash(self, block: Block, h: int, token_ids: tuple[int, ...]) -> None:
        if block.hash is not None or h in self.by_hash:
            return  # already registered, or another block holds these tokens
        block.hash, block.token_ids = h, token_ids
        self.by_hash[h] = block.block_id

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"double free of {block}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.cached[block.block_id] = None
            else:
                self.free.append(block.block_id)


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other sequences free blocks
    NEVER = "never"  # larger than the whole pool


@dataclass
class _Admission:
    """What admitting a group's waiting sequences takes (see `BlockManager._admission`)."""

    num_blocks: int  # distinct blocks in their tables, cached or not
    num_free_needed: int  # blocks taken from the free pool (free or evictable cached)
    num_new_tokens: int  # tokens computed at admission (the uncached tails)


class BlockManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        reserve_tokens: int | None = None,
        watermark_blocks: int = 0,
    ):
        """`reserve_tokens`: when set, each sequence gets blocks for that many tokens at admission
        (the contiguous-reservation baseline, for the KV waste study) instead of on demand."""
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_tokens = reserve_tokens
        self.watermark_blocks = watermark_blocks
        self.tables: dict[int, list[Block]] = {}  # seq_id -> device blocks
        self.cpu_tables: dict[int, list[Block]] = {}  # seq_id -> swap-pool blocks
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    # ---------------------------------------------------------------- queries
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.tables[seq.seq_id]]

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    # ---------------------------------------------------------------- admission
    def _tokens_to_allocate(self, seq: Sequence) -> int:
        return max(len(seq), self.reserve_tokens or 0)

    def _num_shared_prompt_blocks(self, group: SequenceGroup, seqs: list[Sequence]) -> int:
        """Full prompt blocks that the group's sequences share when admitted together (the
        samples of one prompt being recomputed after preemption): each still computes at
        least its last token itself."""
        if len(seqs) < 2:
            return 0
        return min([len(group.prompt_token_ids) // self.block_size] + [(len(s) - 1) // self.block_size for s in seqs])

    def _cache_hits(self, group: SequenceGroup, seq: Sequence) -> list[Block]:
        """The sequence's leading full blocks found in the device prefix cache, up to the first
        miss; empty when the group does not look up the cache. Mutates nothing."""
        hits: list[Block] = []
        if not self._looks_up_cache(group):
            return hits
        for h, toks in self._full_block_hashes(seq.token_ids, group.params.cache_salt):
            block = self.gpu.lookup(h, toks)
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_reused(self, seq: Sequence, hits: list[Block]) -> int:
        """How many of the hits the sequence reuses.
        NOTE: keep at least one token to compute, so the step yields logits."""
        return min(len(hits), (len(seq) - 1) // self.block_size)

    def _admission(self, group: SequenceGroup, seqs: list[Sequence] | None = None) -> _Admission:
        """What admitting `seqs` (default: the group's waiting sequences) now would take, as
        `allocate` does it. Mutates nothing."""
        seqs = group.seqs_with_status(SequenceStatus.WAITING) if seqs is None else seqs
        n_shared = self._num_shared_prompt_blocks(group, seqs)
        cost = _Admission(0, 0, 0)
        for idx, seq in enumerate(seqs):
            n_blocks = self.num_blocks_for(self._tokens_to_allocate(seq))
            if idx > 0 and n_shared:
                reused = live = n_shared  # references on the first sequence's blocks
            elif idx == 0:
                hits = self._cache_hits(group, seq)
                reused = self._num_reused(seq, hits)
                live = sum(1 for b in hits[:reused] if b.ref_count > 0)  # claimed, not taken
            else:
                # NOTE: the first sequence's allocation may evict what this one would find
                # now, so count no hits: an upper bound on its blocks and tokens.
                reused = live = 0
            cost.num_blocks += n_blocks - (reused if idx > 0 else 0)
            cost.num_free_needed += n_blocks - live
            cost.num_new_tokens += len(seq) - reused * self.block_size
        return cost

    def can_allocate(self, group: SequenceGroup, seqs: list[Sequence] | None = None, reserve: int = 0) -> AllocStatus:
        """Whether `seqs` (default: the group's waiting sequences) can get device blocks for all
        their tokens and leave `reserve` blocks free. Prefix-cache hits on blocks that are in
        use (live) take no free block."""
        cost = self._admission(group, seqs)
        if cost.num_blocks > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if cost.num_free_needed + reserve <= self.gpu.num_free - self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_tokens_to_compute(self, group: SequenceGroup, seqs: list[Sequence] | None = None) -> int:
        """Tokens `seqs` (default: the group's waiting sequences) would compute if allocated
        now: their lengths less what the prefix cache (or a sibling sharing the prompt) serves;
        after `allocate`, the sum of their `num_uncomputed_tokens` (at most this). Mutates nothing."""
        return self._admission(group, seqs).num_new_tokens

    def _looks_up_cache(self, group: SequenceGroup) -> bool:
        """Whether the group's prompt may be served from the prefix cache. A request that asks
        for prompt logprobs needs logits for every prompt row, so it computes its whole prompt
        (it still publishes its full blocks for others)."""
        return self.enable_prefix_caching and group.params.prompt_logprobs is None

    def allocate(self, group: SequenceGroup, seqs: list[Sequence] | None = None, register: bool = True) -> None:
        """Give each of `seqs` (default: the group's waiting sequences) a block table covering its
        tokens, reusing cached prefix blocks when prefix caching is on (not for prompt-logprob
        requests), and set `num_computed_tokens` to the reused length. Sequences admitted
        together share the first one's full prompt blocks and get `waits_for` set to it.
        Assumes `can_allocate` said OK for the same `seqs`.
        `register`: publish the new full blocks' hashes now, as the step computes all of them;
        False when the step may compute only part of them (a chunk), whose blocks are
        registered once computed (`register_full_blocks`)."""
        seqs = group.seqs_with_status(SequenceStatus.WAITING) if seqs is None else seqs
        n_shared = self._num_shared_prompt_blocks(group, seqs)
        first: list[Block] = []
        for idx, seq in enumerate(seqs):
            assert seq.seq_id not in self.tables
            table: list[Block] = []
            seq.waits_for = (seqs[0], n_shared * self.block_size) if idx > 0 and n_shared else None
            hashes = self._full_block_hashes(seq.token_ids, group.params.cache_salt)
            if idx > 0 and n_shared:
                # NOTE: the first sequence computes these blocks in this same step; every layer
                # writes all K/V of the step before attending, so the others can read them.
                table = first[:n_shared]
                for b in table:
                    b.ref_count += 1
            elif self._looks_up_cache(group):
                self.prefix_queries += len(seq)
                hits = self._cache_hits(group, seq)
                for b in hits:
                    self.gpu.claim(b)
                table = hits[: self._num_reused(seq, hits)]
                for b in hits[len(table) :]:  # all of it cached: the last block is recomputed
                    self.gpu.release(b)  # (if unreferenced, it is cached again, most recent)
                self.prefix_hits += len(table) * self.block_size
            seq.num_computed_tokens = len(table) * self.block_size
            while len(table) < self.num_blocks_for(self._tokens_to_allocate(seq)):
                table.append(self.gpu.allocate())
            self.tables[seq.seq_id] = table
            if idx == 0:
                first = table
            if self.enable_prefix_caching and register:
                for block, (h, toks) in zip(table, hashes):
                    self.gpu.set_hash(block, h, toks)

    def _full_block_hashes(self, token_ids: list[int], salt: str | None) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of every full block, each hash chained from its parent's."""
        out, parent = [], hash(("paged-serve", salt))
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash((parent, toks))
            out.append((parent, toks))
        return out

    # ---------------------------------------------------------------- decoding
    def _num_append_blocks(self, seqs: list[Sequence], tables: dict[int, list[Block]], refs=None) -> int:
        """Free blocks that `append_slot` on each of `seqs` in turn would take: one for each
        sequence whose last block is full, and a copy for each writer into a shared last block
        except the last writer when no one else holds it. `refs(block)` gives the reference
        count to use (default: the block's own)."""
        refs = refs or (lambda b: b.ref_count)
        need = 0
        writers: dict[int, list] = {}  # shared last block id -> [block, writers]
        for s in seqs:
            table = tables[s.seq_id]
            if len(table) * self.block_size < len(s):
                need += 1
                continue
            last = table[self.num_blocks_for(len(s)) - 1]
            if refs(last) > 1:
                writers.setdefault(last.block_id, [last, 0])[1] += 1
        for block, m in writers.values():
            need += m if refs(block) > m else m - 1
        return need

    def num_append_blocks(self, seqs: list[Sequence]) -> int:
        """Free device blocks that giving each of `seqs` (running) a slot for its next token takes."""
        return self._num_append_blocks(seqs, self.tables)

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get a slot for its next token."""
        return self.num_append_blocks(group.seqs_with_status(SequenceStatus.RUNNING)) <= self.gpu.num_free

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make sure the slot of the sequence's last token exists and is private.
        Returns a (src, dst) copy-on-write pair when a shared block had to be copied."""
        table = self.tables[seq.seq_id]
        if len(table) * self.block_size < len(seq):
            table.append(self.gpu.allocate())
            return None
        idx = self.num_blocks_for(len(seq)) - 1
        last = table[idx]
        if last.ref_count == 1:
            return None
        new = self.gpu.allocate()
        table[idx] = new
        self.gpu.release(last)
        return last.block_id, new.block_id

    def register_full_blocks(self, seq: Sequence, salt: str | None) -> None:
        """With prefix caching, give every full block of the sequence its hash, so blocks of
        generated text (chat history) can be reused by later requests too."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq.seq_id]
        for block, (h, toks) in zip(table, self._full_block_hashes(seq.token_ids[: seq.num_computed_tokens], salt)):
            if block.hash is None and block.ref_count == 1:
                self.gpu.set_hash(block, h, toks)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks (ref counts go up; nothing is copied)."""
        table = self.tables[parent.seq_id]
        for b in table:
            b.ref_count += 1
        self.tables[child.seq_id] = list(table)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, device or swap pool; a no-op if it holds none."""
        for pool, tables in ((self.gpu, self.tables), (self.cpu, self.cpu_tables)):
            for b in reversed(tables.pop(seq.seq_id, [])):
                pool.release(b)

    # ---------------------------------------------------------------- swapping
    def _unique_blocks(self, tables: dict[int, list[Block]], seqs: list[Sequence]) -> dict[int, Block]:
        out: dict[int, Block] = {}
        for s in seqs:
            for b in tables[s.seq_id]:
                out.setdefault(b.block_id, b)
        return out

    def can_swap_out(self, group: SequenceGroup) -> bool:
        blocks = self._unique_blocks(self.tables, group.seqs_with_status(SequenceStatus.RUNNING))
        return len(blocks) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to the swap pool; a block shared inside the group
        is copied once and stays shared. Returns (device block, cpu block) pairs to copy."""
        return self._move(group, SequenceStatus.RUNNING, self.tables, self.gpu, self.cpu_tables, self.cpu)

    def _swap_in_need(self, seqs: list[Sequence], tables: dict[int, list[Block]]) -> int:
        """Device blocks `seqs` take once swapped in and given their next slots: one per distinct
        block of their tables, plus `_num_append_blocks` with the sharing inside the group only
        (swapping copies a block shared with other requests)."""
        local: dict[int, int] = {}
        for s in seqs:
            for b in tables[s.seq_id]:
                local[b.block_id] = local.get(b.block_id, 0) + 1
        return len(local) + self._num_append_blocks(seqs, tables, lambda b: local[b.block_id])

    def can_swap_in(self, group: SequenceGroup) -> bool:
        needed = self._swap_in_need(group.seqs_with_status(SequenceStatus.SWAPPED), self.cpu_tables)
        return needed <= self.gpu.num_free - self.watermark_blocks

    def fits_pool_after_swap(self, group: SequenceGroup) -> bool:
        """Whether the group's running sequences, once swapped out, could come back: what they
        would take at swap-in is at most the whole device pool. Mutates nothing."""
        needed = self._swap_in_need(group.seqs_with_status(SequenceStatus.RUNNING), self.tables)
        return needed <= self.gpu.num_blocks - self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Inverse of swap_out. Returns (cpu block, device block) pairs to copy."""
        return self._move(group, SequenceStatus.SWAPPED, self.cpu_tables, self.cpu, self.tables, self.gpu)

    def _move(self, group, status, src_tables, src_pool, dst_tables, dst_pool) -> list[tuple[int, int]]:
        mapping: dict[int, Block] = {}
        for seq in group.seqs_with_status(status):
            new_table = []
            for b in src_tables.pop(seq.seq_id):
                if b.block_id in mapping:
                    mapping[b.block_id].ref_count += 1
                else:
                    mapping[b.block_id] = dst_pool.allocate()
                new_table.append(mapping[b.block_id])
                src_pool.release(b)
            dst_tables[seq.seq_id] = new_table
        return [(src, dst.block_id) for src, dst in mapping.items()]

    # ---------------------------------------------------------------- checks and views
    def check_integrity(self) -> None:
        """Assert the pool invariants: free + cached + used == total in each pool, and every
        ref count equals the number of tables holding the block."""
        for pool, tables in ((self.gpu, self.tables), (self.cpu, self.cpu_tables)):
            refs = [0] * pool.num_blocks
            for table in tables.values():
                for b in table:
                    refs[b.block_id] += 1
            for b in pool.blocks:
                assert b.ref_count == refs[b.block_id], f"{b} held by {refs[b.block_id]} tables"
            free, cached = set(pool.free), set(pool.cached)
            assert len(free) == len(pool.free), "a block is twice in the free list"
            assert not free & cached, "a block is both free and cached"
            for i in free | cached:
                assert pool.blocks[i].ref_count == 0, f"{pool.blocks[i]} is free but referenced"
            used = sum(1 for b in pool.blocks if b.ref_count > 0)
            assert used + len(free) + len(cached) == pool.num_blocks, "a block is lost"
            for h, i in pool.by_hash.items():
                assert pool.blocks[i].hash == h

    def all_free(self) -> bool:
        return (
            not self.tables
            and not self.cpu_tables
            and self.gpu.num_free == self.gpu.num_blocks
            and self.cpu.num_free == self.cpu.num_blocks
        )

    def usage(self) -> dict[str, float | int]:
        """Pool utilisation and sharing figures for metrics."""
        used = [b for b in self.gpu.blocks if b.ref_count > 0]
        cpu_used = sum(1 for b in self.cpu.blocks if b.ref_count > 0)
        return {
            "gpu_used": len(used),
            "cpu_used": cpu_used,
            "shared_blocks": sum(1 for b in used if b.ref_count > 1),
            "saved_by_sharing": sum(b.ref_count - 1 for b in used),
        }

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """Per device block: 0 free, 1 used, 2 shared, 3 cached; ref counts; per CPU block:
        0 free, 4 swapped."""
        states = []
        for b in self.gpu.blocks:
            if b.ref_count > 1:
                states.append(2)
            elif b.ref_count == 1:
                states.append(1)
            else:
                states.append(3 if b.hash is not None else 0)
        cpu = [4 if b.ref_count else 0 for b in self.cpu.blocks]
        return states, [b.ref_count for b in self.gpu.blocks], cpu
