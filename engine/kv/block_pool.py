"""`BlockPool`: a fixed set of KV blocks with reference counts, a LIFO free list, an LRU set of
cached (freed but still hashed) blocks, and its usage counted as it changes, so that asking
how many blocks are used or shared costs O(1) however large the pool.

Free-list order (a tested contract): blocks are handed out lowest id first from a fresh pool;
freed blocks go to the front of the free list (LIFO), ahead of the blocks never used. A freed
block that holds a full, hashed block of tokens is kept as "cached" instead: it can be claimed
again by hash, and is evicted (its hash dropped) only when the free list is empty, least
recently freed first.

NOTE: freed blocks first because a pool's memory is resident only where it has been written
(on a CPU its pages are mapped zeroed on first touch; docs/using.md, "Sizing the KV cache"): a
never-used block is handed out only when every block used before is taken or cached, so the
blocks ever touched are the most ever held at once, not, as with a FIFO, the whole pool after a
while of serving. Nothing is lost for it: a plain freed block holds nothing worth keeping.
"""

from __future__ import annotations

from collections import OrderedDict, deque


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
    """Every change of a reference count goes through `allocate`, `ref` and `release`, which
    keep `num_used` (ref > 0), `num_shared` (ref > 1) and `num_refs` (their sum) current."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hash kept; oldest first
        self.by_hash: dict[int, int] = {}  # hash -> block id
        self.num_used = 0
        self.num_shared = 0
        self.num_refs = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: free plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def saved_by_sharing(self) -> int:
        """Blocks that sharing saves: the sum over used blocks of (reference count - 1)."""
        return self.num_refs - self.num_used

    def _count(self, block: Block, delta: int) -> None:
        old, new = block.ref_count, block.ref_count + delta
        block.ref_count = new
        self.num_refs += delta
        self.num_used += (new > 0) - (old > 0)
        self.num_shared += (new > 1) - (old > 1)

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
        self._count(block, 1)
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

    def ref(self, block: Block) -> None:
        """Take one more reference (a cached block found by `lookup` leaves the cached set)."""
        if block.ref_count == 0:
            del self.cached[block.block_id]
        self._count(block, 1)

    def set_hash(self, block: Block, h: int, token_ids: tuple[int, ...]) -> None:
        if block.hash is not None or h in self.by_hash:
            return  # already registered, or another block holds these tokens
        block.hash, block.token_ids = h, token_ids
        self.by_hash[h] = block.block_id

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"double free of {block}"
        self._count(block, -1)
        if block.ref_count == 0:
            if block.hash is not None:
                self.cached[block.block_id] = None
            else:
                self.free.appendleft(block.block_id)

    def reset(self) -> None:
        """Back to a fresh pool (every block free, in id order, no hashes): only when no block
        is in use. NOTE: it forgets the cached blocks, as vLLM's reset_prefix_cache does."""
        assert self.num_used == 0, "reset of a pool with blocks in use"
        for block in self.blocks:
            block.hash, block.token_ids = None, None
        self.free = deque(range(len(self.blocks)))
        self.cached.clear()
        self.by_hash.clear()
