"""What the dashboard shows of the KV cache: the pool block by block, the requests that hold
blocks, one request's block tables, and a short log of copy-on-write and preemption events.

Everything here is read-only and built on demand (the engine thread runs it between steps when
GET /kv/blocks or /kv/requests/{id} asks), never per step; the one per-step cost is
`KvEventLog.record`, called by the scheduler for the rare events it logs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass

from engine.core.sequence import SequenceGroup, SequenceStatus

MAX_EVENTS = 64  # the event log's length
MAX_LISTED_REQUESTS = 256  # /kv/blocks lists at most this many requests (and says how many more)


@dataclass
class KvEvent:
    """One thing the scheduler did to a request's blocks.

    `kind`: "cow" (a sequence wrote into a shared block, which was copied `src` -> `dst`),
    "swap_out" / "recompute" (the request was preempted that way), "park" (one extra sample
    gave its blocks back, to be recomputed), "swap_in" (it came back from the CPU pool)."""

    id: int  # increasing: the page shows each event once
    time: float  # wall clock, seconds
    kind: str
    request_id: str
    seq_index: int | None = None  # which choice, for per-sequence events
    logical_block: int | None = None  # "cow": the block's place in the sequence's table
    src: int | None = None  # "cow": the shared physical block
    dst: int | None = None  # "cow": its private copy
    num_blocks: int | None = None  # "swap_out" / "swap_in": blocks moved


class KvEventLog:
    """The last `MAX_EVENTS` events, oldest first (a ring buffer: bounded memory)."""

    def __init__(self, maxlen: int = MAX_EVENTS) -> None:
        self._events: deque[KvEvent] = deque(maxlen=maxlen)
        self._ids = itertools.count(1)

    def record(self, kind: str, request_id: str, **fields: int | None) -> None:
        self._events.append(KvEvent(next(self._ids), time.time(), kind, request_id, **fields))

    def recent(self) -> list[dict]:
        return [asdict(e) for e in self._events]


def _num_blocks(block_manager, group: SequenceGroup) -> int:
    """The distinct blocks the request's sequences hold (shared ones once), in either pool."""
    ids: set[tuple[str, int]] = set()
    for seq in group.seqs:
        pool, table, _ = block_manager.describe_table(seq)
        ids.update((pool, b) for b in table if b >= 0)  # (not RELEASED: out of a window, given back)
    return len(ids)


def request_summaries(scheduler) -> tuple[list[dict], int]:
    """The requests holding blocks (running, then swapped), oldest first: id, queue, number of
    live sequences and distinct blocks. At most MAX_LISTED_REQUESTS; also returns the total."""
    groups = [("running", g) for g in scheduler.running] + [("swapped", g) for g in scheduler.swapped]
    listed = []
    for status, group in groups[:MAX_LISTED_REQUESTS]:
        listed.append({
            "request_id": group.request_id,
            "status": status,
            "num_seqs": len(group.unfinished_seqs),
            "num_blocks": _num_blocks(scheduler.block_manager, group),
            "beam_search": group.is_beam_search,
        })
    return listed, len(groups)


def request_tables(scheduler, request_id: str) -> dict | None:
    """One request's block tables: per unfinished sequence, its logical -> physical mapping
    with each block's ref count (> 1: shared with a sibling or another request) and whether it
    was a prefix-cache hit at admission. None when no queue holds the request (it finished)."""
    found = next(((name, g) for name in ("running", "swapped", "waiting") for g in getattr(scheduler, name)
                  if g.request_id == request_id), None)
    if found is None:
        return None
    status, group = found
    bm = scheduler.block_manager
    num_hit_blocks = group.num_cached_tokens // bm.block_size
    seqs = []
    for seq in group.unfinished_seqs:
        pool, table, refs = bm.describe_table(seq)
        seqs.append({
            "index": seq.index,
            "status": SequenceStatus(seq.status).name.lower(),
            "num_tokens": len(seq),
            "pool": pool,
            "blocks": table,
            "ref_counts": refs,
            "prefix_hit": [pool == "device" and i < num_hit_blocks for i in range(len(table))],
        })
    return {"request_id": request_id, "status": status, "block_size": bm.block_size,
            "num_cached_tokens": group.num_cached_tokens, "sequences": seqs}


def block_map(scheduler, stats) -> dict:
    """The pool block by block (state codes: 0 free, 1 used, 2 shared, 3 cached; CPU: 0 free,
    4 swapped), ref counts, the requests holding blocks and the recent events. O(pool)."""
    bm = scheduler.block_manager
    states, refs, cpu = bm.block_states()
    requests, num_requests = request_summaries(scheduler)
    return {
        "block_size": bm.block_size,
        "num_blocks": len(states),
        "num_cpu_blocks": len(cpu),
        "blocks": states,
        "ref_counts": refs,
        "cpu_blocks": cpu,
        "usage": stats.kv_cache_usage,
        "fragmentation": stats.kv_internal_fragmentation,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_swapped": stats.num_swapped,
        "requests": requests,
        "num_requests_with_blocks": num_requests,
        "events": scheduler.events.recent(),
    }
