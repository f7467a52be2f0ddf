"""Liveness under KV pressure, as a property: random workloads and pool sizes through the real
Scheduler and BlockManager (no model), with the engine's post-step bookkeeping simulated:
samples fork after the prompt (n / best_of), beams fork and drop every step, prefilled blocks are
registered for the prefix cache, prompt logprobs are computed at the prompt's last step,
sequences finish at max_tokens (ignore_eos).

Asserted at every step: the pool invariants (`check_integrity`), the budgets, that beams are
scheduled together. At the end: every request finished, within the bound that the scheduler's
docstring derives (W = s * (pre + M) steps after it became the oldest), and the pool is whole
and free. The first example is the issue's reproducer: one n=16 request that outgrows the pool
(and the swap pool) wedged the engine for good.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from engine.core.config import SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.kv.block_manager import BlockManager
from engine.sched.scheduler import Scheduler
from engine.worker.persistent_batch import PersistentBatch


@dataclass(frozen=True)
class Req:
    arrival: int  # the step before which it is added
    prompt_len: int
    max_tokens: int
    best_of: int
    beam: bool
    prefix: int  # how many leading tokens come from the shared base prompt (prefix caching)
    prompt_logprobs: bool = False  # scored chunk by chunk (engine/sample/prompt_logprobs.py)


@dataclass(frozen=True)
class World:
    gpu_blocks: int
    cpu_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    budget: int
    chunked: bool
    prefix_caching: bool
    mode: str
    max_preemptions: int
    reqs: tuple[Req, ...]
    seed: int
    # the step-time target (target_itl_ms, target_ttft_ms in steps of the test's clock, where a
    # step "takes" 1 + D/10 + P/4 ms): None, or a cap that is often down to its floor
    cap: tuple[float, float | None] | None = None
    policy: str = "fcfs"  # the scheduling policy (engine/sched/admission_order.py)
    # each layer group's sliding window (engine/core/kv_layout.py): windowed groups give blocks back
    windows: tuple[int | None, ...] = (None,)


def admissible(w: World, r: Req) -> bool:
    """The engine's admission checks (LLMEngine._validate): context, width, beams that fit."""
    if r.prompt_len + r.max_tokens > w.max_model_len or r.best_of > w.max_num_seqs:
        return False
    blocks = len(w.windows) * -(-(r.prompt_len + r.max_tokens) // w.block_size)
    return not r.beam or r.best_of * blocks <= w.gpu_blocks


def bound(w: World, r: Req) -> int:
    """Steps within which a request finishes once it is the oldest (scheduler docstring)."""
    pre = r.prompt_len + r.max_tokens if w.chunked else 1
    return r.best_of * (pre + r.max_tokens) + 1


def make_group(w: World, i: int, r: Req) -> SequenceGroup:
    # NOTE: ids within the tiny model's vocabulary (1024); the tails differ between requests.
    base = [3 + (7 * k) % 1000 for k in range(r.prefix)]
    ids = base + [3 + (500 + 97 * i + 13 * k) % 1000 for k in range(r.prompt_len - r.prefix)]
    params = SamplingParams(n=2 if r.beam else 1, best_of=r.best_of, max_tokens=r.max_tokens, ignore_eos=True,
                            use_beam_search=r.beam, temperature=0.0 if r.beam else 1.0,
                            prompt_logprobs=1 if r.prompt_logprobs else None)
    g = SequenceGroup(f"r{i}", None, ids, params, arrival_time=float(r.arrival))
    return g


def step_ms(decodes: int, prefill: int, rng: random.Random) -> float:
    """What a step of the simulated engine "takes" (the cost model's input)."""
    return (1.0 + decodes / 10 + prefill / 4) * rng.uniform(0.9, 1.1)


def step(sched: Scheduler, rng: random.Random, w: World, batch: PersistentBatch) -> list[SequenceGroup]:
    """One engine step without a model; returns the requests that finished. `batch`: a
    tensor-parallel worker's copy of the tables, fed only each step's changes."""
    bm = sched.block_manager
    oldest = sched.oldest()
    out = sched.schedule()
    batch.apply(out.table_changes)
    assert batch.tables == bm.tables, "a worker's copy of the tables drifted from the block manager's"
    # The oldest request advances every step (the liveness argument's premise), whatever order
    # the step runs its chunk in.
    assert oldest is None or any(s.group is oldest for s in out.scheduled), oldest.request_id
    if sched.step_cost is not None:  # what LLMEngine.step reports of the step's time
        d = sum(not s.is_prefill for s in out.scheduled)
        p = sum(s.num_tokens for s in out.scheduled if s.is_prefill)
        sched.step_cost.observe(d, p, 0, step_ms(d, p, rng) / 1000.0)
        if sched.step_cost.coefficients() is not None:
            event("step-time cap active")
    assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
    running = [s for g in sched.running for s in g.seqs if s.status == SequenceStatus.RUNNING]
    assert len(running) <= w.max_num_seqs  # (forks may pass it until the next step parks extras)
    if any(g.request_id in out.preempted for g in [*sched.waiting, *sched.swapped]):
        # a request was preempted whole: no extra sample may run in its place
        assert all(len(g.seqs_with_status(SequenceStatus.RUNNING)) <= 1 or g.is_beam_search for g in sched.running)
    # no step passes the budget, prompt-logprob requests' included
    assert out.num_batched_tokens <= w.budget
    beams: dict[str, list] = {}
    for s in out.scheduled:
        assert s.block_table == bm.block_table(s.seq)
        g = s.group
        if s.is_prefill and g.prompt_logprobs_pending and s.seq is g.seqs[0]:
            # what engine/sample/prompt_logprobs.py gathers: this chunk's rows score the positions after
            # them; none may be left unscored before the chunk (prefix hits stop short of them)
            so_far, start, prompt = g.prompt_logprobs_so_far, s.start, g.prompt_token_ids
            assert start < len(so_far), (g.request_id, start, len(so_far))
            so_far.extend({} for _ in range(len(so_far), min(start + s.num_tokens + 1, len(prompt))))
            if start + s.num_tokens >= len(prompt):
                g.prompt_logprobs = so_far
                if start > 0:
                    event("prompt logprobs over several chunks")
        # NOTE: what Scheduler.update_from_output does first (the forks below need it)
        assert s.start == bm.num_computed_tokens(s.seq)
        bm.mark_computed(s.seq, s.num_tokens, None)
        assert bm.num_computed_tokens(s.seq) <= len(s.seq)
        if not s.samples:
            continue
        assert bm.num_uncomputed_tokens(s.seq) == 0
        assert not g.prompt_logprobs_pending, "sampled before its prompt logprobs were complete"
        if g.is_beam_search:
            beams.setdefault(g.request_id, [g, []])[1].append(s.seq)
            continue
        seqs = [s.seq]
        if not g.forked:
            for k in range(1, g.params.best_of):
                child = s.seq.fork(k, None)
                bm.fork(s.seq, child)
                g.seqs.append(child)
                seqs.append(child)
            g.forked = True
        for seq in seqs:
            seq.output_token_ids.append(rng.randrange(50))
            if len(seq.output_token_ids) >= g.params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH
    for g, seqs in beams.values():
        beam_step(g, seqs, bm, rng)
    done = sched.free_finished()
    bm.check_integrity()
    return done


def beam_step(g: SequenceGroup, seqs: list, bm: BlockManager, rng: random.Random) -> None:
    """What engine/sample/beam_search.py does to a request's sequences: k next beams from random
    parents (a parent's first child continues it, others fork it), unchosen parents dropped."""
    assert sorted(s.seq_id for s in seqs) == sorted(s.seq_id for s in g.unfinished_seqs), "beams not together"
    g.beam_state = g.beam_state or object()
    if len(seqs[0].output_token_ids) + 1 >= g.params.max_tokens:
        for seq in seqs:
            seq.output_token_ids.append(1)
            seq.status = SequenceStatus.FINISHED_LENGTH
        return
    parents = [rng.choice(seqs) for _ in range(g.params.best_of)]
    taken, growing = set(), []
    for p in parents:
        if p.seq_id not in taken:
            taken.add(p.seq_id)
            growing.append(p)
        else:
            child = p.fork(p.index, None)
            bm.fork(p, child)
            g.seqs.append(child)
            growing.append(child)
    for seq in growing:
        seq.output_token_ids.append(rng.randrange(50))
    for seq in seqs:
        if seq.seq_id not in taken:
            bm.free(seq)
            g.seqs.remove(seq)


def run(w: World) -> int:
    """Run the workload to the end, asserting the properties; returns the preemptions it took."""
    itl, ttft = w.cap or (None, None)
    cfg = SchedulerConfig(w.max_num_seqs, w.budget, w.max_model_len, w.mode, w.max_preemptions,
                          enable_chunked_prefill=w.chunked, target_itl_ms=itl,
                          target_ttft_ms=ttft * 1000.0 if ttft is not None else None, scheduling_policy=w.policy)
    bm = BlockManager(w.gpu_blocks, w.cpu_blocks, w.block_size, enable_prefix_caching=w.prefix_caching,
                      windows=w.windows)
    t = 0
    sched = Scheduler(cfg, bm, clock=lambda: float(t))  # NOTE: arrival times are step numbers
    assert (sched.step_cost is not None) == (w.cap is not None and w.chunked)
    rng = random.Random(w.seed)
    if sched.step_cost is not None:  # NOTE: taught the step's cost up front, so the cap acts from the start
        for d, p in ((1, 0), (4, 0), (1, 8), (4, 16)) * 4:
            sched.step_cost.observe(d, p, 0, step_ms(d, p, rng) / 1000.0)
    reqs = [r for r in w.reqs if admissible(w, r)]
    groups = [make_group(w, i, r) for i, r in enumerate(reqs)]
    order = sorted(range(len(reqs)), key=lambda i: groups[i].priority)
    finished_at: dict[str, int] = {}
    batch = PersistentBatch()
    limit = max((r.arrival for r in reqs), default=0) + sum(bound(w, r) for r in reqs) + 1
    while len(finished_at) < len(groups):
        for g, r in zip(groups, reqs):
            if r.arrival == t:
                sched.add(g)
        t += 1
        for g in step(sched, rng, w, batch):
            finished_at[g.request_id] = t
        assert t <= limit, f"no progress: {len(finished_at)}/{len(groups)} finished after {t} steps"
    # Each request finished within its bound of becoming the oldest: no starvation.
    oldest_since = 0
    for i in order:
        g, r = groups[i], reqs[i]
        start = max(r.arrival, oldest_since)
        assert finished_at[g.request_id] <= start + bound(w, r), (g.request_id, finished_at, start, bound(w, r))
        oldest_since = max(oldest_since, finished_at[g.request_id])
    assert not sched.has_unfinished()
    bm.check_integrity()
    assert not bm.tables and not bm.cpu_tables and bm.all_free(), "a table or a sequence's KV record leaked"
    batch.apply(bm.take_table_changes())
    assert not batch.tables, "a worker still holds tables of finished sequences"
    assert bm.device.num_free == bm.device.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks
    return sum(sched.num_preemptions.values())


@st.composite
def worlds(draw) -> World:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.integers(1, 40))
    windows = draw(st.sampled_from([(None,), (None,), (window,), (None, window), (None, window, window)]))
    G = len(windows)  # every group's table holds the whole context at admission
    gpu = draw(st.integers(2 * G, 32 * G))
    # NOTE: a context of at least half the pool, so that a few requests fill it.
    max_len = draw(st.integers(max(2, min(gpu // G * bs, 96) // 2), min(gpu // G * bs, 96)))
    chunked = draw(st.booleans())
    seqs = draw(st.integers(1, 12))
    budget = draw(st.integers(max(seqs, 1 if chunked else max_len), max(seqs, max_len) + 64))
    reqs = []
    for _ in range(draw(st.integers(1, 6))):
        p = draw(st.integers(1, max_len - 1))
        beam = draw(st.booleans()) and seqs >= 2
        reqs.append(Req(arrival=draw(st.integers(0, 12)), prompt_len=p,
                        max_tokens=draw(st.integers(1, max(1, min(max_len - p, 32)))),
                        best_of=draw(st.integers(2 if beam else 1, min(seqs, 6 if beam else 12))), beam=beam,
                        prefix=draw(st.integers(0, p)), prompt_logprobs=not beam and draw(st.booleans())))
    cap = draw(st.one_of(st.none(), st.tuples(st.floats(0.5, 20.0), st.one_of(st.none(), st.integers(1, 40)))))
    return World(gpu, draw(st.integers(0, 48)), bs, max_len, seqs, budget, chunked, draw(st.booleans()),
                 draw(st.sampled_from(["swap", "recompute"])), draw(st.integers(0, 3)), tuple(reqs),
                 draw(st.integers(0, 2**16)), cap, draw(st.sampled_from(["fcfs", "shortest-prompt"])), windows)


# The reproducer: --max-model-len 1024 --kv-cache-memory 64MiB --swap-space 0.0625 on
# SmolLM2 (91 blocks of 16 tokens, as many swap blocks), one n=16 request for 1000 tokens.
REPRODUCER = World(91, 91, 16, 1024, 64, 2048, False, True, "swap", 8,
                   (Req(0, 2, 1000, 16, False, 0), Req(5, 3, 3, 1, False, 0)), 0)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_reproducer_request_outgrowing_the_pool_finishes_and_the_next_one_too(mode):
    run(World(**{**REPRODUCER.__dict__, "mode": mode}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(World(8, 8, 4, 32, 4, 32, False, False, "swap", 8, (Req(0, 3, 29, 4, False, 0),), 1))
@example(World(8, 0, 4, 32, 4, 32, True, True, "recompute", 0, (Req(0, 20, 12, 2, True, 8),
                                                               Req(1, 20, 12, 2, True, 8)), 2))
@example(World(32, 8, 2, 64, 8, 40, True, True, "swap", 2, tuple(Req(i, 30 + i, 20, 1 + i % 3, False, 4)
                                                                 for i in range(6)), 3, (2.0, None)))
@example(World(16, 0, 4, 48, 3, 12, True, False, "recompute", 1, (Req(0, 40, 6, 1, False, 0),) + tuple(
    Req(i % 3, 2 + i, 4, 1 + i % 2, False, 0) for i in range(1, 6)), 4, None, "shortest-prompt"))
@example(World(24, 12, 2, 32, 4, 40, True, True, "swap", 2, tuple(Req(i, 20 + i, 10, 1 + i % 3, i == 2, 6)
                                                                 for i in range(4)), 5, None, "fcfs", (5,)))
@example(World(30, 20, 2, 20, 4, 24, True, False, "swap", 1, tuple(Req(i, 12 + i, 8, 1 + i % 2, i == 1, 0)
                                                                  for i in range(4)), 6, None, "fcfs", (None, 3, 3)))
@given(worlds())
def test_every_admitted_request_finishes_within_the_bound(w):
    event("preempted" if run(w) else "no preemption")
    event(f"layer groups: {len(w.windows)}, windowed: {w.windows[-1] is not None}")


# ------------------------------------------------------------------- the real engine, tiny model
ENGINE_CASES = [  # (chunked, prefix caching, preemption mode, block size, device blocks, swap blocks, target ITL,
    #                 scheduling policy)
    (False, False, "swap", 4, 24, 24, None, "fcfs"),
    (False, True, "recompute", 2, 40, 0, None, "shortest-prompt"),
    (True, False, "recompute", 4, 20, 8, 0.5, "fcfs"),  # NOTE: a target no step meets: the cap at its floor
    (True, True, "swap", 1, 80, 40, None, "shortest-prompt"),
]


@pytest.mark.parametrize("chunked, prefix, mode, bs, gpu, cpu, itl, policy", ENGINE_CASES)
def test_engine_finishes_random_workloads_on_a_small_pool(chunked, prefix, mode, bs, gpu, cpu, itl, policy):
    """The engine itself (tiny dummy model): n / best_of / beams up to max_num_seqs, prompts
    sharing prefixes, arrivals over time; every request ends with its full output within the
    bound, and the pool is free at the end."""
    from engine.loop.engine_args import EngineArgs
    from engine.loop.llm_engine import LLMEngine

    max_len, seqs = gpu * bs, 6
    args = EngineArgs(model="tiny-4kv", load_format="dummy", max_model_len=min(max_len, 64), block_size=bs,
                      num_gpu_blocks_override=gpu, swap_space=cpu * 4096 * bs / 1024**3, max_num_seqs=seqs,
                      max_num_batched_tokens=32 if chunked else 64, enable_chunked_prefill=chunked,
                      enable_prefix_caching=prefix, preemption_mode=mode, max_preemptions_per_request=2,
                      target_itl_ms=itl, scheduling_policy=policy)
    engine = LLMEngine(args.create_engine_config())
    w = World(gpu, cpu, bs, engine.config.model.max_model_len, seqs, engine.config.scheduler.max_num_batched_tokens,
              chunked, prefix, mode, 2, (), 0)
    rng = random.Random(hash((chunked, prefix, mode)))
    for _ in range(3):
        reqs = []
        for i in range(rng.randint(2, 5)):
            p = rng.randint(1, w.max_model_len - 2)
            beam = rng.random() < 0.3
            reqs.append(Req(rng.randint(0, 6), p, rng.randint(1, min(w.max_model_len - p, 20)),
                            rng.randint(2, seqs) if beam else rng.randint(1, seqs), beam, rng.randint(0, p),
                            not beam and rng.random() < 0.3))
        run_engine(engine, w, reqs, rng)


def run_engine(engine, w: World, reqs: list[Req], rng: random.Random) -> None:
    added: dict[str, tuple[Req, int]] = {}
    finals: dict[str, object] = {}
    finished_at: dict[str, int] = {}
    pending = sorted(enumerate(reqs), key=lambda x: x[1].arrival)
    t = 0
    limit = max(r.arrival for r in reqs) + sum(bound(w, r) for r in reqs) + 1
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival <= t:
            i, r = pending.pop(0)
            g = make_group(w, i, r)
            params = g.params
            if not r.beam and rng.random() < 0.5:
                params = SamplingParams(n=r.best_of, max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0,
                                        prompt_logprobs=params.prompt_logprobs)
            rid = f"{id(reqs)}-{i}"
            try:
                engine.add_request(rid, g.prompt_token_ids, params)
            except ValueError as e:
                assert not admissible(w, r), e
                continue
            added[rid] = (r, t)
        t += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                finished_at[out.request_id] = t
        assert t <= limit, f"no progress after {t} steps"
    for rid, (r, arrived) in added.items():
        out = finals[rid]
        assert out.error is None, out.error
        assert len(out.outputs) == (2 if r.beam else out.outputs and len(out.outputs))
        for choice in out.outputs:
            assert choice.finish_reason == "length" and len(choice.token_ids) <= r.max_tokens
            if not r.beam:
                assert len(choice.token_ids) == r.max_tokens
    bm = engine.block_manager
    bm.check_integrity()
    assert not bm.tables and not bm.cpu_tables and bm.device.num_free == bm.device.num_blocks
