"""`KvUsage`: the KV pools' counters at one moment, as the block manager reports them to metrics
(engine/loop/stats.py) without handing out its pools."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvUsage:
    """The pools' counters at one moment (`BlockManager.usage`), for metrics: O(1) to take."""

    num_device_blocks: int
    num_free_device_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    device_used: int  # device blocks with a reference
    cpu_used: int
    shared_blocks: int  # device blocks held by more than one table
    saved_by_sharing: int  # references past the first on shared blocks
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, found
