"""Block manager: property tests over random walks, and exact-id contracts for the free list
and the prefix-cache eviction order. No model, no tensors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import SequenceGroup, SequenceStatus
from engine.kv.block_manager import AllocStatus, BlockManager


def make_group(n_tokens: int, rid: str = "r", first_token: int = 0, salt=None, **params) -> SequenceGroup:
    ids = [(first_token + i) % 1000 for i in range(n_tokens)]
    return SequenceGroup(rid, None, ids, SamplingParams(max_tokens=None, cache_salt=salt, **params))


def admit(bm: BlockManager, group: SequenceGroup) -> None:
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    for s in group.seqs:
        s.status = SequenceStatus.RUNNING
        bm.mark_computed(s, bm.num_uncomputed_tokens(s), group.params.cache_salt)


def grow(bm: BlockManager, seq, token: int = 7, salt=None):
    seq.output_token_ids.append(token)
    cow = bm.append_slot(seq)
    bm.mark_computed(seq, bm.num_uncomputed_tokens(seq), salt)
    return cow


def test_fresh_pool_hands_out_lowest_ids_and_reuses_freed_blocks_first():
    bm = BlockManager(8, 0, 4)
    a, b = make_group(6, "a"), make_group(3, "b")
    admit(bm, a)
    admit(bm, b)
    assert bm.block_table(a.seqs[0]).tolist() == [0, 1]
    assert bm.block_table(b.seqs[0]).tolist() == [2]
    bm.free(a.seqs[0])  # freed blocks go to the front of the free list, last block first
    assert list(bm.device.free) == [0, 1, 3, 4, 5, 6, 7]
    c = make_group(20, "c")
    admit(bm, c)
    assert bm.block_table(c.seqs[0]).tolist() == [0, 1, 3, 4, 5]
    bm.free(b.seqs[0])
    bm.free(c.seqs[0])
    bm.check_integrity()
    assert bm.all_free()


def test_new_block_only_when_last_is_full():
    bm = BlockManager(8, 0, 4)
    g = make_group(3)
    admit(bm, g)
    seq = g.seqs[0]
    assert len(bm.block_table(seq)) == 1
    grow(bm, seq)  # 4 tokens: still one block
    assert len(bm.block_table(seq)) == 1
    grow(bm, seq)  # 5 tokens: a second block
    assert len(bm.block_table(seq)) == 2
    bm.free(seq)
    assert bm.all_free()


def test_copy_on_write_only_for_shared_partial_block():
    bm = BlockManager(8, 0, 4)
    g = make_group(6)
    admit(bm, g)
    parent = g.seqs[0]
    child = parent.fork(1, None)
    g.seqs.append(child)
    bm.fork(parent, child)
    assert bm.block_table(parent).tolist() == bm.block_table(child).tolist() == [0, 1]
    bm.check_integrity()
    cow = grow(bm, parent)  # writes into shared block 1: copied
    assert cow == ((1, 2),)  # (one layer group: one pair)
    assert bm.block_table(parent).tolist() == [0, 2]
    assert grow(bm, child) is None  # block 1 is now the child's alone: written in place
    assert bm.block_table(child).tolist() == [0, 1]
    assert bm.device.blocks[0].ref_count == 2  # the full prompt block stays shared
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.all_free()


def test_prompt_larger_than_pool_never_fits():
    bm = BlockManager(4, 0, 4)
    assert bm.can_allocate(make_group(17)) is AllocStatus.NEVER
    assert bm.can_allocate(make_group(16)) is AllocStatus.OK


def test_prefix_cache_reuses_blocks_and_evicts_least_recently_freed():
    bm = BlockManager(6, 0, 4, enable_prefix_caching=True)
    a = make_group(9, "a")  # blocks 0,1 full (hashed), 2 partial
    admit(bm, a)
    assert bm.block_table(a.seqs[0]).tolist() == [0, 1, 2]
    b = make_group(9, "b")  # same prompt: reuses 0 and 1, computes the rest
    assert bm.can_allocate(b) is AllocStatus.OK
    bm.allocate(b)
    assert bm.block_table(b.seqs[0])[:2].tolist() == [0, 1]
    assert bm.num_computed_tokens(b.seqs[0]) == 8
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])
    bm.check_integrity()
    # free list: b's private block 3 and a's partial block 2 (freed last first), then 4, 5
    # (never used); the shared prompt blocks are cached, in the order their last reference
    # went: 1, 0
    assert list(bm.device.free) == [3, 2, 4, 5]
    assert list(bm.device.cached) == [1, 0]
    old_hashes = {bm.device.blocks[0].hash, bm.device.blocks[1].hash}
    c = make_group(24, "c", first_token=500)  # 6 blocks: takes every free block, then evicts 1, 0
    assert bm.can_allocate(c) is AllocStatus.OK
    bm.allocate(c)
    assert bm.block_table(c.seqs[0]).tolist() == [3, 2, 4, 5, 1, 0]
    assert not bm.device.cached and not old_hashes & set(bm.device.by_hash)  # evicted
    bm.free(c.seqs[0])
    bm.check_integrity()


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(6, 0, 4, enable_prefix_caching=True)
    a = make_group(8, "a")
    admit(bm, a)
    bm.free(a.seqs[0])
    b = make_group(8, "b")
    bm.allocate(b)
    assert bm.num_computed_tokens(b.seqs[0]) == 4  # the last block is recomputed to get logits
    bm.free(b.seqs[0])
    bm.check_integrity()


def test_cache_salt_separates_tenants():
    bm = BlockManager(6, 0, 4, enable_prefix_caching=True)
    a = make_group(9, "a", salt="tenant-1")
    admit(bm, a)
    b = make_group(9, "b", salt="tenant-2")
    bm.allocate(b)
    assert bm.num_computed_tokens(b.seqs[0]) == 0
    assert not set(bm.block_table(a.seqs[0])) & set(bm.block_table(b.seqs[0]))
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])


def test_prompt_logprobs_request_computes_its_whole_prompt_but_publishes_its_blocks():
    """Prompt logprobs need logits for every prompt row not scored yet: no cache hit (no query
    counted) before any is scored, hits only before the last scored position after; the
    request's full blocks still go to the cache for the requests after it."""
    bm = BlockManager(8, 0, 4, enable_prefix_caching=True)
    a = make_group(9, "a")
    admit(bm, a)  # blocks 0, 1 (full, hashed), 2
    p = make_group(9, "p", prompt_logprobs=0)  # the same prompt
    assert bm.can_allocate(p) is AllocStatus.OK
    assert bm.num_tokens_to_compute(p) == 9
    bm.allocate(p)
    assert bm.num_computed_tokens(p.seqs[0]) == 0
    assert bm.block_table(p.seqs[0]).tolist() == [3, 4, 5]
    assert (bm.prefix_queries, bm.prefix_hits) == (9, 0)  # a's lookup only
    bm.free(a.seqs[0])
    bm.free(p.seqs[0])
    bm.check_integrity()
    # With an empty cache, a prompt-logprob request's blocks are what the next request reuses.
    bm = BlockManager(8, 0, 4, enable_prefix_caching=True)
    p = make_group(9, "p", prompt_logprobs=2)
    admit(bm, p)
    assert bm.block_table(p.seqs[0]).tolist() == [0, 1, 2]
    bm.free(p.seqs[0])
    b = make_group(9, "b")
    bm.allocate(b)
    assert bm.block_table(b.seqs[0]).tolist() == [0, 1, 2]  # its partial block 2 freed, reused
    assert bm.num_computed_tokens(b.seqs[0]) == 8
    assert (bm.prefix_queries, bm.prefix_hits) == (9, 8)
    # Scores gathered for positions 0..5 (a recompute part way through the prompt): the cache
    # serves the tokens before position 5, whole blocks of them (one of 4); all once complete.
    q = make_group(9, "q", prompt_logprobs=1)
    q.prompt_logprobs_so_far.extend({} for _ in range(5))
    assert q.cacheable_prompt_tokens == 5
    assert bm.num_tokens_to_compute(q) == 5
    q.prompt_logprobs = q.prompt_logprobs_so_far
    assert q.cacheable_prompt_tokens is None and bm.num_tokens_to_compute(q) == 1
    bm.free(b.seqs[0])
    bm.check_integrity()


def pool_state(bm: BlockManager):
    return list(bm.device.free), list(bm.device.cached), dict(bm.device.by_hash), [b.ref_count for b in bm.device.blocks]


def test_cached_prefix_hits_cost_no_tokens_and_live_ones_no_free_block():
    """The admission queries mutate nothing and agree with allocate: hits on blocks in use take
    no free block, hits on cached (unreferenced) blocks take one each, and only the uncached
    tail counts as tokens to compute."""
    bm = BlockManager(4, 0, 4, enable_prefix_caching=True)
    a = make_group(9, "a")
    admit(bm, a)  # blocks 0, 1 (full, hashed), 2; block 3 free
    b = make_group(9, "b")  # the same prompt, while a runs
    before = pool_state(bm)
    assert bm.num_tokens_to_compute(b) == 1
    assert bm.can_allocate(b) is AllocStatus.OK  # 0 and 1 are shared: needs 1 block, not 3
    assert pool_state(bm) == before
    bm.allocate(b)
    assert bm.block_table(b.seqs[0]).tolist() == [0, 1, 3]
    assert bm.num_uncomputed_tokens(b.seqs[0]) == 1
    assert bm.can_allocate(make_group(9, "c")) is AllocStatus.LATER  # shares 0, 1; no block left
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])
    bm.check_integrity()
    assert (list(bm.device.free), list(bm.device.cached)) == ([3, 2], [1, 0])

    x = make_group(7, "x", first_token=500)  # takes the 2 free blocks: 3 (full), 2
    admit(bm, x)
    assert bm.block_table(x.seqs[0]).tolist() == [3, 2]
    d = make_group(9, "d")  # hits cached 0 and 1 (unreferenced): each takes a pool block
    before = pool_state(bm)
    assert bm.num_tokens_to_compute(d) == 1
    assert bm.can_allocate(d) is AllocStatus.LATER  # 3 blocks from a pool of 2
    assert bm.can_allocate(make_group(8, "e")) is AllocStatus.OK  # 0 reused, 1 recomputed: 2
    assert pool_state(bm) == before
    bm.free(x.seqs[0])
    assert bm.can_allocate(d) is AllocStatus.OK
    bm.allocate(d)
    assert bm.block_table(d.seqs[0]).tolist() == [0, 1, 2]  # x's partial 2, freed; its full 3 cached
    assert bm.num_uncomputed_tokens(d.seqs[0]) == 1
    bm.free(d.seqs[0])
    bm.check_integrity()


def test_whole_cached_prompt_counts_its_last_block_as_tokens_to_compute():
    bm = BlockManager(6, 0, 4, enable_prefix_caching=True)
    a = make_group(8, "a")
    admit(bm, a)
    b = make_group(8, "b")
    assert bm.num_tokens_to_compute(b) == 4
    bm.allocate(b)
    assert bm.num_uncomputed_tokens(b.seqs[0]) == 4
    assert bm.block_table(b.seqs[0]).tolist() == [0, 2]
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])
    bm.check_integrity()


def test_swap_keeps_sharing_inside_a_group():
    bm = BlockManager(8, 8, 4)
    g = make_group(6)
    admit(bm, g)
    parent = g.seqs[0]
    child = parent.fork(1, None)
    g.seqs.append(child)
    bm.fork(parent, child)
    assert bm.can_swap_out(g)
    pairs = bm.swap_out(g)
    assert len(pairs) == 2  # two unique blocks, copied once each
    g.set_status(SequenceStatus.SWAPPED)
    assert bm.cpu_tables[parent.seq_id] == bm.cpu_tables[child.seq_id]
    assert bm.device.num_free == 8
    bm.check_integrity()
    assert bm.can_swap_in(g)
    back = bm.swap_in(g)
    g.set_status(SequenceStatus.RUNNING)
    assert len(back) == 2
    assert bm.block_table(parent) == bm.block_table(child)
    assert all(bm.device.blocks[b].ref_count == 2 for b in bm.block_table(parent))
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.all_free()


def admit_checked(bm: BlockManager, g: SequenceGroup) -> None:
    """Admit a group that can_allocate accepted; the admission estimates must bound (and, for
    a group of one sequence, equal) what allocate takes."""
    seqs = g.seqs_with_status(SequenceStatus.WAITING)
    free_before, tokens = bm.num_free_device_blocks, bm.num_tokens_to_compute(g)
    needed = bm.plan(g).num_free_needed
    bm.allocate(g)
    computed = sum(bm.num_uncomputed_tokens(s) for s in seqs)
    taken = free_before - bm.num_free_device_blocks
    if len(seqs) == 1:
        assert (computed, taken) == (tokens, needed)
    else:
        assert computed <= tokens and taken <= needed
    for s in seqs:
        s.status = SequenceStatus.RUNNING
        bm.mark_computed(s, bm.num_uncomputed_tokens(s), g.params.cache_salt)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4, 16]),
       prefix=st.booleans())
def test_random_walk_keeps_invariants(seed, block_size, prefix):
    """allocate / append / fork / swap / free at random: no leak, ref counts match the tables,
    every token has a slot, copy-on-write only when a shared partial block is written, and the
    blocks ever written are no more than the most held at once (freed ones are reused first)."""
    rng = random.Random(seed)
    bm = BlockManager(48, 24, block_size, enable_prefix_caching=prefix)
    touched = {"device": watch_touches(bm.device), "cpu": watch_touches(bm.cpu)}
    live: list[SequenceGroup] = []
    swapped: list[SequenceGroup] = []
    for step in range(120):
        op = rng.random()
        if op < 0.25:
            g = make_group(rng.randint(1, 40), f"g{step}", first_token=rng.choice([0, 0, step]))
            if bm.can_allocate(g) is AllocStatus.OK:
                admit_checked(bm, g)
                live.append(g)
            else:  # turned away: forgotten as the scheduler forgets a request it drops
                bm.free(g.seqs[0])
        elif op < 0.6 and live:
            g = rng.choice(live)
            running = g.seqs_with_status(SequenceStatus.RUNNING)
            for seq in running:  # the engine appends sampled tokens, then asks for their slots
                seq.output_token_ids.append(rng.randint(0, 999))
            if not bm.can_append_slots(g):
                for seq in running:
                    seq.output_token_ids.pop()
                continue
            for seq in running:
                table_before = list(bm.block_table(seq))  # (the live list changes)
                shared_before = [bm.device.blocks[b].ref_count > 1 for b in table_before]
                cow = bm.append_slot(seq)
                bm.mark_computed(seq, bm.num_uncomputed_tokens(seq), None)
                if cow is not None:
                    (pair,) = cow  # one layer group
                    idx = table_before.index(pair[0])
                    assert shared_before[idx], "copied a block that was not shared"
                    assert (len(seq) - 1) // block_size == idx, "copied a block it does not write"
        elif op < 0.7 and live:
            g = rng.choice(live)
            seqs = g.seqs_with_status(SequenceStatus.RUNNING)
            child = seqs[0].fork(len(g.seqs), None)
            g.seqs.append(child)
            bm.fork(seqs[0], child)
        elif op < 0.8 and live:
            g = rng.choice(live)
            if bm.can_swap_out(g):
                bm.swap_out(g)
                g.set_status(SequenceStatus.SWAPPED)
                live.remove(g)
                swapped.append(g)
        elif op < 0.84 and live:  # recompute preemption: freed, prefilled again (forks too)
            g = rng.choice(live)
            live.remove(g)
            for seq in g.unfinished_seqs:
                bm.free_to_recompute(seq)
                seq.status = SequenceStatus.WAITING
            if bm.can_allocate(g) is AllocStatus.OK:
                admit_checked(bm, g)
                live.append(g)
            else:
                g.set_status(SequenceStatus.FINISHED_ABORTED)
                for seq in g.seqs:
                    bm.free(seq)
        elif op < 0.9 and swapped:
            g = swapped[0]
            if bm.can_swap_in(g):
                bm.swap_in(g)
                g.set_status(SequenceStatus.RUNNING)
                swapped.remove(g)
                live.append(g)
        elif live or swapped:
            pool = live + swapped
            g = rng.choice(pool)
            for seq in g.seqs:
                bm.free(seq)
            (live if g in live else swapped).remove(g)
        bm.check_integrity()
        check_read_only_views(bm, live, swapped)
        for ids, most_held in touched.values():
            # a never-used block only when every block used before was taken or cached
            assert len(ids) == most_held[0]
    for g in live + swapped:
        for seq in g.seqs:
            bm.free(seq)
    bm.check_integrity()
    assert bm.all_free()


def watch_touches(pool) -> tuple[set[int], list[int]]:
    """Record, as `pool` hands blocks out, every block id it ever handed out and the most
    blocks it ever held at once (in use or cached), the high point only an allocation reaches."""
    ids, most_held = set(), [0]
    allocate = pool.allocate

    def counted():
        block = allocate()
        ids.add(block.block_id)
        most_held[0] = max(most_held[0], pool.num_used + len(pool.cached))
        return block

    pool.allocate = counted
    return ids, most_held


def check_read_only_views(bm: BlockManager, live: list[SequenceGroup], swapped: list[SequenceGroup]) -> None:
    """What others read of the block manager agrees with its state: every token of a running
    sequence has a slot and is computed, `describe_table` and `num_slots` give its table and
    the blocks' ref counts, `usage` counts what the tables hold."""
    used = {"device": set(), "cpu": set()}
    for g in live + swapped:
        for seq in g.unfinished_seqs:
            pool, table, refs = bm.describe_table(seq)
            assert pool == ("device" if g in live else "cpu")
            blocks = bm.device.blocks if pool == "device" else bm.cpu.blocks
            assert refs == [blocks[i].ref_count for i in table] and all(r >= 1 for r in refs)
            used[pool].update(table)
            if seq.status == SequenceStatus.RUNNING:
                assert list(bm.block_table(seq)) == table and bm.num_slots(seq) == len(table) * bm.block_size
                assert bm.num_slots(seq) >= len(seq) == bm.num_computed_tokens(seq)
    usage = bm.usage()
    assert (usage.device_used, usage.cpu_used) == (len(used["device"]), len(used["cpu"]))
    assert usage.num_free_device_blocks == bm.num_free_device_blocks <= usage.num_device_blocks - usage.device_used


def test_a_sequence_holds_no_kv_state():
    """A Sequence is tokens, status and sampling state: what the cache holds of it is the block
    manager's record, which it drops when the sequence is freed."""
    bm = BlockManager(8, 0, 4, enable_prefix_caching=True)
    g = make_group(9)
    for name in ("num_computed_tokens", "num_uncomputed_tokens", "block_hashes", "num_registered_blocks", "waits_for"):
        assert not hasattr(g.seqs[0], name), name
    admit(bm, g)
    assert bm.num_computed_tokens(g.seqs[0]) == 9 and bm.kv[g.seqs[0].seq_id].block_hashes
    bm.free(g.seqs[0])
    assert bm.num_computed_tokens(g.seqs[0]) == 0 and bm.all_free()


def test_only_the_scheduler_changes_the_block_manager():
    """Ownership, read from the source: the block manager's changing methods are called from
    the scheduler alone (StepPlan takes its slots through the scheduler's `take_slot`), and a
    sequence's KV record is written in the block manager and its prefix cache alone."""
    import re
    from pathlib import Path

    import engine

    changing = ("allocate", "append_slot", "fork", "free", "free_to_recompute", "mark_computed",
                "mark_all_computed", "swap_in",
                "swap_out", "reset", "take_table_changes")
    call = re.compile(r"(?:block_manager|\bbm)\.(%s)\b" % "|".join(changing))
    write = re.compile(r"\.(num_computed_tokens|num_registered_blocks|block_hashes|waits_for)\s*(?:\+|-)?=[^=]")
    for path in Path(engine.__file__).parent.rglob("*.py"):
        text = path.read_text()
        if path.name not in ("scheduler.py", "block_manager.py"):
            assert not call.findall(text), f"{path.name} changes the block manager: {call.findall(text)}"
        if path.name not in ("block_manager.py", "block_swap.py", "prefix_cache.py"):  # (block_swap: its base class)
            assert not write.findall(text), f"{path.name} writes KV state: {write.findall(text)}"


@pytest.mark.parametrize("reserve", [64])
def test_reserve_mode_allocates_max_len_up_front(reserve):
    bm = BlockManager(64, 0, 16, reserve_tokens=reserve)
    g = make_group(10)
    admit(bm, g)
    assert len(bm.block_table(g.seqs[0])) == 4
    for _ in range(40):
        assert grow(bm, g.seqs[0]) is None
    assert len(bm.block_table(g.seqs[0])) == 4
    bm.free(g.seqs[0])
    assert bm.all_free()
