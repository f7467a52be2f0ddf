"""`StatsCollector`: the engine's running totals (tokens, finished requests by reason) and the
per-step `EngineStats` snapshot the server exports. Reads the scheduler and the block manager
(their counters are O(1)), never changes them."""

from __future__ import annotations

from engine.core.outputs import RequestMetrics
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.core.step import SchedulerOutput
from engine.kv.block_manager import BlockManager
from engine.loop.metrics import EngineStats
from engine.sched.scheduler import Scheduler


class StatsCollector:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, bytes_per_block: int) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.bytes_per_block = bytes_per_block
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}  # finished requests by finish reason ("abort" included)
        self.ttfts: list[float] = []  # this step's events
        self.itls: list[float] = []
        self.finished: list[RequestMetrics] = []

    def progress(self, group: SequenceGroup, num_new_tokens: int, now: float) -> None:
        """A request got `num_new_tokens` tokens this step: its latencies and the totals."""
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.ttfts.append(now - m.arrival_time)
            # NOTE: counted at the first sample, not at a prefill step: a chunked prompt may be
            # preempted (and swapped) before its last chunk.
            self.prompt_tokens += len(group.prompt_token_ids)
        else:
            self.itls.append(now - m.last_token_time)
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += num_new_tokens
        self.generation_tokens += num_new_tokens

    def finish(self, group: SequenceGroup, now: float) -> None:
        m = group.metrics
        m.finished_time = now
        statuses = {s.status for s in group.seqs}
        if SequenceStatus.FINISHED_ABORTED in statuses or group.error is not None:
            m.finish_reason = "abort"  # the metrics' label; clients never see it
        else:
            m.finish_reason = "stop" if SequenceStatus.FINISHED_STOPPED in statuses else "length"
        self.success[m.finish_reason] = self.success.get(m.finish_reason, 0) + 1
        self.finished.append(m)

    def snapshot(self, out: SchedulerOutput) -> EngineStats:
        """The state after the step that ran `out`, with the step's events (which it clears)."""
        bm, sched = self.block_manager, self.scheduler
        total_slots = filled = 0
        num_slots, running = bm.num_slots, SequenceStatus.RUNNING
        for group in sched.running:
            for seq in group.seqs:
                if seq.status == running:
                    slots = num_slots(seq)
                    total_slots += slots
                    filled += min(len(seq.prompt_token_ids) + len(seq.output_token_ids), slots)
        kv = bm.usage()
        stats = EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_device_blocks=kv.num_device_blocks,
            num_free_device_blocks=kv.num_free_device_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            kv_cache_usage=kv.device_used / max(kv.num_device_blocks, 1),
            cpu_cache_usage=kv.cpu_used / max(kv.num_cpu_blocks, 1),
            kv_internal_fragmentation=(total_slots - filled) / total_slots if total_slots else 0.0,
            num_shared_blocks=kv.shared_blocks,
            num_blocks_saved_by_sharing=kv.saved_by_sharing,
            num_preemptions_total=dict(sched.num_preemptions),
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            prefix_cache_queries_total=kv.prefix_queries,
            prefix_cache_hits_total=kv.prefix_hits,
            swap_in_bytes_total=sched.swapped_blocks["in"] * self.bytes_per_block,
            swap_out_bytes_total=sched.swapped_blocks["out"] * self.bytes_per_block,
            request_success_total=dict(self.success),
            iteration_tokens=out.num_batched_tokens,
            finished_requests=self.finished,
            time_to_first_tokens=self.ttfts,
            inter_token_latencies=self.itls,
        )
        self.ttfts, self.itls, self.finished = [], [], []
        return stats
