"""What the tensor-parallel driver sends each step (engine/worker/persistent_batch.py), measured without
starting a worker: the real Scheduler and BlockManager, a fake model step, and the message the
executor broadcasts, pickled as `parallel.broadcast_object` pickles it.

The structure test: at 64 decoding sequences the bytes a step sends must not grow with the
context (2,000 tokens against 16), where whole block tables grew with it."""

from __future__ import annotations

import dataclasses
import pickle
import random

from engine.worker.model_runner import StepInput
from engine.worker.persistent_batch import PersistentBatch, for_workers
from tests.engine.test_scheduler import complete, group, make_scheduler

NUM_SEQS = 64
BLOCK_SIZE = 16
DECODE_STEPS = 2 * BLOCK_SIZE + 1  # every sequence gains a block at least twice


def message_bytes(step: StepInput) -> int:
    """The pickled size of the executor's broadcast for `step` (`("execute", (step,))`)."""
    return len(pickle.dumps(("execute", (step,))))


def decode_step_bytes(context: int) -> tuple[int, int]:
    """(largest message with whole block tables, largest as sent now) over decode steps of
    NUM_SEQS sequences of `context` prompt tokens, once every prompt is in."""
    blocks = NUM_SEQS * (-(-(context + DECODE_STEPS + 1) // BLOCK_SIZE))
    sched = make_scheduler(num_blocks=blocks, cpu_blocks=0, block_size=BLOCK_SIZE, max_seqs=NUM_SEQS,
                           max_tokens=NUM_SEQS * context, mode="recompute")
    for i in range(NUM_SEQS):
        sched.add(group(f"r{i}", context, max_tokens=DECODE_STEPS + 2, t=i, first=1 + i))
    complete(sched, sched.schedule())  # every prompt prefilled in one step: the tables go out whole once
    whole = sent = 0
    for _ in range(DECODE_STEPS):
        out = sched.schedule()
        assert len(out.scheduled) == NUM_SEQS and not any(s.is_prefill for s in out.scheduled)
        step = StepInput.from_scheduler_output(out)
        # before: each SeqInput carried its table (the matrix rows are never pickled)
        whole = max(whole, message_bytes(dataclasses.replace(step, table_changes=[])))
        sent = max(sent, message_bytes(for_workers(step)))
        complete(sched, out)
    return whole, sent


def test_step_bytes_do_not_grow_with_the_context():
    whole_long, sent_long = decode_step_bytes(2000)
    whole_short, sent_short = decode_step_bytes(16)
    print(f"\nbytes per decode step at {NUM_SEQS} sequences: whole tables {whole_short} (16 tokens) -> "
          f"{whole_long} (2,000 tokens); changes only {sent_short} -> {sent_long}")
    assert whole_long > 5 * whole_short  # what the test guards against: tables grow with the context
    # NOTE: a little slack for wider ints in the pickle (positions and block ids past 255)
    assert sent_long <= 1.25 * sent_short, (sent_short, sent_long)
    assert sent_long < whole_long / 5


def test_a_worker_rebuilds_the_tables_the_driver_runs():
    """Through preemptions (swap and recompute) and finished requests, a worker fed only the
    steps it is sent (an empty step is held back, its changes sent with the next) runs each
    sequence on the table the driver's block manager holds."""
    rng = random.Random(0)
    for mode in ("swap", "recompute"):
        sched = make_scheduler(num_blocks=24, cpu_blocks=32, block_size=4, max_seqs=6, max_tokens=64, mode=mode)
        batch, unsent, t = PersistentBatch(), [], 0
        for _ in range(200):
            if rng.random() < 0.3:
                t += 1
                sched.add(group(f"r{t}", rng.randint(1, 20), max_tokens=rng.randint(1, 30), t=t, first=t))
            out = sched.schedule()
            step = StepInput.from_scheduler_output(out)
            if not step.seqs and not step.blocks_to_swap_in and not step.blocks_to_swap_out:
                unsent.extend(step.table_changes)  # what MultiProcessExecutor.execute does
            else:
                wire = pickle.loads(pickle.dumps(for_workers(step, unsent)))
                unsent = []
                restored = batch.restore(wire)
                assert [list(s.block_table) for s in restored.seqs] == [list(s.block_table) for s in step.seqs]
            complete(sched, out)
        assert sum(sched.num_preemptions.values()) > 0, "the walk never preempted"
