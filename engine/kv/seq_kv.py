"""`SeqKv`: one sequence's KV bookkeeping, kept by the block manager beside its block table.

Only `BlockManager` (engine/kv/block_manager.py) writes it; the scheduler and the rest read what
they need through the block manager's methods (`num_computed_tokens`, `pending_share`, ...), so
that a `Sequence` holds only its tokens, status and sampling state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence


@dataclass(slots=True, eq=False)
class SeqKv:
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    # prefix caching (engine/kv/prefix_cache.py): the chain of hashes of its full blocks so far,
    # and how many of its leading blocks it has published
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Admitted together with a sibling whose first prompt blocks it shares: (that sibling, its
    # record, the shared tokens). The sibling computes them; until it has, this one runs only
    # in a step where the sibling's chunk reaches them (engine/sched/step_plan.py). NOTE: the
    # sibling's record, not a lookup by id: it outlives the sibling's finishing.
    waits_for: tuple[Sequence, SeqKv, int] | None = None
