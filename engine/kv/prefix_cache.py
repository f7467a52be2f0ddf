"""`PrefixCache`: the content hashes behind prefix reuse, over the device `BlockPool`.

Each sequence keeps the chain of its full blocks' hashes (`SeqKv.block_hashes`, each hash
chained from its parent's and salted by the request's `cache_salt`), extended only when a block
fills, and a cursor of the blocks it has published (`SeqKv.num_registered_blocks`): per step the
work is for the new blocks only, whatever the sequence's length. `num_hashes` counts the hashes
computed (tests count it). The block manager owns it, with the records it reads and extends:
nothing else calls it.

Layer groups (engine/core/kv_layout.py): each group's blocks are published under their own hash
(`group_hash`); a hit of n blocks takes group 0's blocks [0, n) (`hits`) and every other group's
from its first live block to n (`group_blocks`), and the block manager shortens n until all are
cached (`BlockManager._group_hits`).
"""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup
from engine.kv.block_pool import Block, BlockPool
from engine.kv.seq_kv import SeqKv


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.num_hashes = 0  # block hashes computed (each once per sequence)

    def block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        """The tokens of the sequence's i-th block."""
        a, b = i * self.block_size, (i + 1) * self.block_size
        prompt, n = seq.prompt_token_ids, len(seq.prompt_token_ids)
        if b <= n:
            return tuple(prompt[a:b])
        if a >= n:
            return tuple(seq.output_token_ids[a - n: b - n])
        return tuple(prompt[a:]) + tuple(seq.output_token_ids[: b - n])

    def chain(self, seq: Sequence, kv: SeqKv, salt: str | None, n: int) -> list[int]:
        """The sequence's hash chain (`kv.block_hashes`), extended to (at least) its first `n`
        full blocks."""
        chain = kv.block_hashes
        parent = chain[-1] if chain else hash(("paged-serve", salt))
        for i in range(len(chain), n):
            parent = hash((parent, self.block_tokens(seq, i)))
            chain.append(parent)
            self.num_hashes += 1
        return chain

    def cacheable_blocks(self, group: SequenceGroup, seq: Sequence) -> int:
        """How many of the sequence's leading full blocks the cache may serve: none when
        disabled; for a request with prompt logprobs still to compute, only those before its
        last scored position (`SequenceGroup.cacheable_prompt_tokens`: the rows that score the
        others must run; it publishes its full blocks for others as any request does)."""
        if not self.enabled:
            return 0
        limit = group.cacheable_prompt_tokens
        return len(seq) // self.block_size if limit is None else min(len(seq), limit) // self.block_size

    def hits(self, group: SequenceGroup, seq: Sequence, kv: SeqKv) -> list[Block]:
        """The sequence's leading full blocks found in the pool, up to the first miss or
        `cacheable_blocks`. Mutates nothing but the chain."""
        found: list[Block] = []
        num = self.cacheable_blocks(group, seq)
        for i, h in enumerate(self.chain(seq, kv, group.params.cache_salt, num) if num else ()):
            block = self.pool.lookup(h, self.block_tokens(seq, i))
            if block is None:
                break
            found.append(block)
        return found

    def group_blocks(self, seq: Sequence, kv: SeqKv, k: int, lo: int, m: int) -> tuple[list[Block], int]:
        """Layer group `k`'s cached blocks for the sequence's blocks [lo, m) (its chain holds at
        least m hashes): (the blocks, -1), or ([], the highest index missing)."""
        found = []
        for i in range(m - 1, lo - 1, -1):
            block = self.pool.lookup(group_hash(kv.block_hashes[i], k), self.block_tokens(seq, i))
            if block is None:
                return [], i
            found.append(block)
        found.reverse()
        return found, -1

    def publish(self, seq: Sequence, kv: SeqKv, tables, salt: str | None, n: int) -> None:
        """Publish the hashes of the sequence's full blocks up to the n-th (those past its
        cursor; `tables`: its device block ids in each layer group, group k's hashed with
        `group_hash`), so later requests can reuse them."""
        if not self.enabled or n <= kv.num_registered_blocks:
            return
        chain = self.chain(seq, kv, salt, n)
        for k, table in enumerate(tables):
            for i in range(kv.num_registered_blocks, min(n, len(table))):
                if table[i] < 0:  # RELEASED (engine/core/table_rows.py): out of a window, given back
                    continue
                block = self.pool.blocks[table[i]]
                if block.hash is None:
                    self.pool.set_hash(block, group_hash(chain[i], k), self.block_tokens(seq, i))
        kv.num_registered_blocks = n


def group_hash(h: int, k: int) -> int:
    """The hash of layer group `k`'s block whose chain hash is `h` (group 0's is `h` itself): the
    same tokens' K/V in other layers are other blocks."""
    return h if k == 0 else hash((h, "layer group", k))
