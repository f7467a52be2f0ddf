"""Part (c) of benchmarks/kv_waste.py, `window`: what giving back the blocks that fall out of a
sliding window saves (engine/core/kv_layout.py), on the real block manager and scheduler with no
model. A Gemma-3-shaped model (by default Gemma-3 1B's KV: 26 layers, 5 windowed layers of
window 512 for each full one, 1 KV head of 256, bf16) at 8k context, two ways in one pool of
fixed bytes:
  - keep: one group of all layers, every layer's blocks kept (what a pool without windows does);
  - free: the hybrid layout (a full group, windowed groups of the same size in bytes), each
          windowed group's out-of-window blocks given back as the sequence's tokens are computed.
It reports the KV bytes one sequence holds at 8k context (its live blocks x bytes per block),
how many 8k sequences the pool holds at once (admitted one after another through
`BlockManager.plan` / `allocate`, each computed, until the next does not fit), and a scheduler
run: requests of 8k context (prompt + decode, chunked prefill) all at once, the peak of
sequences running together, the steps it took and the preemptions.

    python -m benchmarks.kv_waste window --layers 26 --window 512 --context 8192 --pool-gib 2
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from engine.core.config import SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.kv.block_manager import AllocStatus, BlockManager
from engine.core.kv_layout import kv_layout
from engine.sched.scheduler import Scheduler


@dataclass(frozen=True)
class WindowShape:
    """The KV shape of a model with sliding-window layers (default: Gemma-3 1B)."""

    layers: int = 26
    window: int = 512
    pattern: int = 6  # every pattern-th layer attends to the whole context, the others to the window
    kv_heads: int = 1
    head_size: int = 256
    dtype_bytes: int = 2  # bf16

    def windows(self) -> list[int | None]:
        return [None if (i + 1) % self.pattern == 0 else self.window for i in range(self.layers)]


@dataclass(frozen=True)
class WindowResult:
    mode: str  # "keep" | "free"
    groups: int
    slots: int  # layers per group (padding included)
    bytes_per_block: int
    pool_blocks: int
    bytes_per_seq: int  # KV one sequence holds at `context` tokens
    seqs_fit: int  # sequences of `context` tokens the pool holds at once
    run_peak_running: int  # the scheduler run's most sequences running in one step
    run_steps: int
    run_preemptions: int
    run_seconds: float


def _group(rid: str, prompt_len: int, max_tokens: int) -> SequenceGroup:
    ids = [3 + (7 * i) % 1000 for i in range(prompt_len)]
    return SequenceGroup(rid, None, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def fill(bm: BlockManager, context: int) -> tuple[int, int]:
    """Admit and compute sequences of `context` tokens one after another until the next one does
    not fit; returns (how many, the live blocks the first holds). Frees them after."""
    held, first_blocks = [], 0
    while True:
        g = _group(f"f{len(held)}", context, 1)
        if bm.plan(g).status is not AllocStatus.OK:
            bm.free(g.seqs[0])  # (its record, made by `plan`)
            break
        bm.allocate(g)
        seq = g.seqs[0]
        seq.status = SequenceStatus.RUNNING
        bm.mark_computed(seq, context, None)
        first_blocks = first_blocks or bm.num_live_blocks(seq)
        held.append(seq)
    bm.check_integrity()
    for seq in held:
        bm.free(seq)
    assert bm.all_free()
    return len(held), first_blocks


def scheduler_run(bm: BlockManager, context: int, num_requests: int, decode: int,
                  budget: int) -> tuple[int, int, int]:
    """`num_requests` requests of `context - decode` prompt tokens and `decode` output tokens,
    all at once, through the real scheduler (chunked prefill, recompute preemption) with the
    engine's post-step bookkeeping simulated; returns (peak sequences running in a step, steps,
    preemptions)."""
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget, max_model_len=context,
                             preemption_mode="recompute", max_preemptions_per_request=8, enable_chunked_prefill=True)
    sched = Scheduler(config, bm)
    for i in range(num_requests):
        sched.add(_group(f"r{i}", context - decode, decode))
    peak = steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        peak = max(peak, len(out.scheduled))
        for s in out.scheduled:
            if s.samples:
                s.seq.output_token_ids.append(1)
                if len(s.seq.output_token_ids) >= s.group.params.max_tokens:
                    s.seq.status = SequenceStatus.FINISHED_LENGTH
        sched.update_from_output(out)
        assert steps < 100 * num_requests * (context // budget + decode), "no progress"
    bm.check_integrity()
    assert bm.all_free()
    return peak, steps, sum(sched.num_preemptions.values())


def measure(shape: WindowShape, free: bool, context: int, pool_bytes: int, block_size: int, num_requests: int,
            decode: int, budget: int) -> WindowResult:
    layout = kv_layout(shape.windows(), free_windows=free)
    # NOTE: a block holds K and V of `slots` layers (padding included): the KV tensor's
    # [2, slots, blocks, kv_heads, block_size, head_size] (engine/core/kv_layout.py)
    per_block = 2 * layout.slots * shape.kv_heads * block_size * shape.head_size * shape.dtype_bytes
    blocks = pool_bytes // per_block

    def manager() -> BlockManager:
        return BlockManager(blocks, 0, block_size, windows=layout.windows)

    seqs_fit, live = fill(manager(), context)
    t0 = time.perf_counter()
    peak, steps, preemptions = scheduler_run(manager(), context, num_requests, decode, budget)
    return WindowResult("free" if free else "keep", len(layout.groups), layout.slots, per_block, blocks,
                        live * per_block, seqs_fit, peak, steps, preemptions, time.perf_counter() - t0)


def run_window_comparison(shape: WindowShape, context: int, pool_bytes: int, block_size: int = 16,
                          num_requests: int = 64, decode: int = 1024, budget: int = 2048) -> dict:
    """Both modes on the same pool bytes; the report's `runs` and the savings."""
    logging.getLogger("engine.sched.scheduler").setLevel(logging.ERROR)  # (a warning per preemption)
    keep, free = (measure(shape, f, context, pool_bytes, block_size, num_requests, decode, budget)
                  for f in (False, True))
    return {"runs": [asdict(keep), asdict(free)],
            "bytes_saved": 1 - free.bytes_per_seq / keep.bytes_per_seq,
            "seqs_gain": free.seqs_fit / max(1, keep.seqs_fit),
            "params": {**asdict(shape), "context": context, "pool_bytes": pool_bytes, "block_size": block_size,
                       "num_requests": num_requests, "decode": decode, "budget": budget}}


def format_window_table(report: dict) -> str:
    p = report["params"]
    lines = [f"Sliding-window blocks given back: {p['layers']} layers (1 full per {p['pattern']}), window "
             f"{p['window']}, {p['kv_heads']} KV head(s) of {p['head_size']}, {p['dtype_bytes']} B/elem, blocks of "
             f"{p['block_size']}, {p['context']}-token context, pool {p['pool_bytes'] / 2**30:.2f} GiB",
             f"{'mode':<6}{'groups':>7}{'slots':>6}{'KiB/block':>10}{'blocks':>8}{'MiB/seq':>9}{'fit':>6}"
             f"{'peak run':>10}{'steps':>7}{'preempt':>9}"]
    for r in report["runs"]:
        lines.append(f"{r['mode']:<6}{r['groups']:>7}{r['slots']:>6}{r['bytes_per_block'] / 1024:>10.0f}"
                     f"{r['pool_blocks']:>8}{r['bytes_per_seq'] / 2**20:>9.1f}{r['seqs_fit']:>6}"
                     f"{r['run_peak_running']:>10}{r['run_steps']:>7}{r['run_preemptions']:>9}")
    lines.append(f"free vs keep: {100 * report['bytes_saved']:.1f}% fewer KV bytes per sequence, "
                 f"{report['seqs_gain']:.2f}x the sequences that fit")
    return "\n".join(lines)
