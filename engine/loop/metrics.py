"""Engine-side statistics: a snapshot after every step that the server exports to Prometheus.

Gauges are the state after the step; `*_total` fields are cumulative counters since start;
the lists are events that happened during this step only (each step's snapshot carries its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.outputs import RequestMetrics


@dataclass
class EngineStats:
    timestamp: float = field(default_factory=time.monotonic)
    # Gauges.
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0
    num_swapped: int = 0
    num_device_blocks: int = 0  # device pool size (the KV pool where attention reads; CPU memory on CPU serving)
    num_free_device_blocks: int = 0
    num_cpu_blocks: int = 0  # swap pool size
    num_free_cpu_blocks: int = 0
    kv_cache_usage: float = 0.0  # used / total device blocks, 0..1
    cpu_cache_usage: float = 0.0  # used / total swap blocks, 0..1
    kv_internal_fragmentation: float = 0.0  # allocated slots holding no token / allocated slots
    num_shared_blocks: int = 0  # blocks with ref count > 1
    num_blocks_saved_by_sharing: int = 0  # sum over blocks of (ref count - 1)
    # Cumulative counters.
    num_preemptions_total: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found
    swap_in_bytes_total: int = 0
    swap_out_bytes_total: int = 0
    request_success_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    # This step's events.
    iteration_tokens: int = 0  # tokens processed by this step's forward pass
    finished_requests: list[RequestMetrics] = field(default_factory=list)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
