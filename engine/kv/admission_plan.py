"""`AdmissionPlan`: what admitting some of a request's waiting sequences takes, as
`BlockManager.plan` computes it and `BlockManager.allocate` carries it out; `AllocStatus`: whether
it fits. Plain data between the block manager and the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.kv.block_pool import Block


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other sequences free blocks
    NEVER = "never"  # larger than the whole pool


@dataclass
class AdmissionPlan:
    """What admitting some of a group's waiting sequences takes, computed once by `plan` and
    carried out by `allocate` (valid while no device block is allocated in between)."""

    status: AllocStatus
    seqs: list[Sequence]
    hits: list[Block] = field(default_factory=list)  # the first sequence's leading cached blocks
    # layer groups 1.. (engine/core/kv_layout.py): each one's cached blocks from its first live
    # block (of num_reused blocks computed) to num_reused
    group_hits: list[list[Block]] = field(default_factory=list)
    num_reused: int = 0  # how many of `hits` it reuses (it computes at least its last token)
    num_shared: int = 0  # full prompt blocks the other sequences share with the first
    num_free_needed: int = 0  # blocks taken from the free pool (free or evictable cached)
    num_new_tokens: int = 0  # tokens computed at admission (the uncached tails)
