"""Automatic prefix caching and prompt sharing, observed through the engine on the default model:
a warm hit reuses the very blocks of the cold run and decodes the same tokens; the eviction
order holds as a contract (exact block ids); cache_salt keeps tenants apart; stats count
queried and hit tokens; and n = 4 samples of a 512-token prompt hold one copy of the prompt."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from tests.engine.prompts import prompt_of_length

BLOCK = 16
CACHED = {"block_size": BLOCK, "enable_prefix_caching": True}
COLD = {"block_size": BLOCK}  # the fixtures' default: prefix caching off


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def record_tables(engine, monkeypatch) -> dict[str, list[list[int]]]:
    """request id -> the block table of its (first) sequence at every step it ran."""
    tables: dict[str, list[list[int]]] = {}
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        seen = set()
        for s in out.scheduled:
            if s.group.request_id not in seen:
                seen.add(s.group.request_id)
                tables.setdefault(s.group.request_id, []).append(list(s.block_table))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    return tables


def run(engine, requests: list[tuple[str, list[int], SamplingParams]]):
    """Add the requests together and step until they finish; request id -> final output."""
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_integrity()
    return done


def test_warm_hit_reuses_blocks_and_decodes_like_a_cold_run(make_llm, monkeypatch):
    ids = prompt_of_length(make_llm(**COLD).tokenizer, 100, offset_words=17)  # 6 full blocks + 4
    other = prompt_of_length(make_llm(**COLD).tokenizer, 30, offset_words=333)
    cold = make_llm(**COLD).generate([ids], greedy(8))[0].outputs[0].token_ids

    engine = make_llm(**CACHED).engine
    tables = record_tables(engine, monkeypatch)
    first = run(engine, [("first", ids, greedy(8))])["first"]
    stats0 = engine.last_stats
    warm = run(engine, [("warm", ids, greedy(8))])["warm"]
    stats1 = engine.last_stats

    assert warm.num_cached_tokens == 96  # every full prompt block; the rest is computed
    assert tables["warm"][0][:6] == tables["first"][0][:6]  # the same physical blocks
    # the partial block is computed anew (num_cached_tokens), into the block that "first" freed:
    # freed blocks are handed out before never-used ones
    assert tables["warm"][0][6] == tables["first"][0][6]
    assert first.outputs[0].token_ids == warm.outputs[0].token_ids == cold
    assert stats1.prefix_cache_queries_total - stats0.prefix_cache_queries_total == 100
    assert stats1.prefix_cache_hits_total - stats0.prefix_cache_hits_total == 96

    # Two requests admitted in the same step share the prefix too (the first computes it), and
    # a prompt that only starts the same way reuses the blocks it has in common.
    branch = ids[:64] + other
    both = run(engine, [("a", ids, greedy(8)), ("b", ids, greedy(8)), ("branch", branch, greedy(4))])
    assert tables["a"][0][:6] == tables["b"][0][:6] == tables["first"][0][:6]
    assert tables["branch"][0][:4] == tables["first"][0][:4]
    assert both["branch"].num_cached_tokens == 64
    assert both["a"].outputs[0].token_ids == both["b"].outputs[0].token_ids == cold


def test_whole_cached_prompt_recomputes_only_its_last_block(make_llm, monkeypatch):
    ids = prompt_of_length(make_llm(**COLD).tokenizer, 64, offset_words=71)  # exactly 4 blocks
    cold = make_llm(**COLD).generate([ids], greedy(8))[0].outputs[0].token_ids
    engine = make_llm(**CACHED).engine
    tables = record_tables(engine, monkeypatch)
    run(engine, [("first", ids, greedy(8))])
    warm = run(engine, [("warm", ids, greedy(8))])["warm"]
    # NOTE: a step needs one token to compute, so the last full block is computed again.
    assert warm.num_cached_tokens == 48
    assert tables["warm"][0][:3] == tables["first"][0][:3]
    assert warm.outputs[0].token_ids == cold


def test_eviction_order_is_least_recently_used_first(make_llm):
    """A scripted series on a fresh 10-block pool, with exact block ids: freed full blocks stay
    cached (last block first in line), plain freed blocks are handed out first (before
    never-used ones), and cached ones are evicted least recently used first, so a prefix used
    again survives an older one."""
    llm = make_llm(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=10, max_model_len=160)
    engine, bm = llm.engine, llm.engine.block_manager
    assert list(bm.device.free) == list(range(10)) and not bm.device.cached, "needs a fresh engine"
    tok = llm.tokenizer
    a = prompt_of_length(tok, 40, offset_words=0)  # 2 full blocks + 8 tokens
    b = prompt_of_length(tok, 40, offset_words=100)
    d = prompt_of_length(tok, 120, offset_words=200)  # 7 full blocks + 8 tokens
    one = greedy(1)  # one token: each request ends with its prompt step

    def serve(rid, ids) -> int:
        """Run one request alone; the prompt tokens it found cached."""
        return run(engine, [(rid, ids, one)])[rid].num_cached_tokens

    # Each request's blocks are freed last block first: the partial one goes to the front of the
    # free list, full ones join the cached set (oldest first), deepest block first.
    assert serve("A", a) == 0  # blocks 0, 1, 2
    assert list(bm.device.free) == [2, 3, 4, 5, 6, 7, 8, 9] and list(bm.device.cached) == [1, 0]
    assert serve("B", b) == 0  # blocks 2 (A's freed partial one), 3, 4
    assert list(bm.device.free) == [4, 5, 6, 7, 8, 9] and list(bm.device.cached) == [1, 0, 3, 2]
    assert serve("A again", a) == 32  # blocks 0, 1 from the cache, its tail in 4
    assert list(bm.device.free) == [4, 5, 6, 7, 8, 9] and list(bm.device.cached) == [3, 2, 1, 0]
    assert serve("D", d) == 0  # 8 blocks: the 6 free ones, then evicts B's 3 and 2
    assert list(bm.device.free) == [2] and list(bm.device.cached) == [1, 0, 3, 9, 8, 7, 6, 5, 4]
    assert serve("A third", a) == 32  # used more recently than B: A's blocks survived D
    assert list(bm.device.free) == [2] and list(bm.device.cached) == [3, 9, 8, 7, 6, 5, 4, 1, 0]
    assert serve("B again", b) == 0  # B's were evicted; takes 2, then evicts D's deepest: 3, 9
    assert list(bm.device.free) == [9] and list(bm.device.cached) == [8, 7, 6, 5, 4, 1, 0, 3, 2]
    bm.check_integrity()


def test_cache_salt_separates_tenants(make_llm, monkeypatch):
    ids = prompt_of_length(make_llm(**COLD).tokenizer, 48, offset_words=255)
    engine = make_llm(**CACHED).engine
    tables = record_tables(engine, monkeypatch)
    out = run(
        engine,
        [("t1", ids, greedy(4, cache_salt="tenant-1"))],
    )
    out.update(run(engine, [("t2", ids, greedy(4, cache_salt="tenant-2"))]))
    out.update(run(engine, [("t1 again", ids, greedy(4, cache_salt="tenant-1"))]))
    assert out["t2"].num_cached_tokens == 0
    assert not set(tables["t2"][0]) & set(tables["t1"][0])
    assert out["t1 again"].num_cached_tokens == 32
    assert tables["t1 again"][0][:2] == tables["t1"][0][:2]
    assert out["t1"].outputs[0].token_ids == out["t2"].outputs[0].token_ids == out["t1 again"].outputs[0].token_ids


@pytest.mark.parametrize("prompt_len", [512, 500])
def test_parallel_samples_hold_one_copy_of_the_prompt(make_llm, monkeypatch, prompt_len):
    """n = 4 samples of a long prompt: at its peak the request holds at most the prompt's
    blocks, 4 x the generated blocks and 4 more (copied partial blocks), not 4 prompts."""
    engine = make_llm(**COLD).engine
    bm = engine.block_manager
    peak = 0
    schedule = engine.scheduler.schedule

    def measuring_schedule():
        nonlocal peak
        out = schedule()  # the pool is fullest right after scheduling (new and copied blocks)
        peak = max(peak, bm.usage().device_used)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", measuring_schedule)
    new = 20
    ids = prompt_of_length(engine.tokenizer, prompt_len, offset_words=5)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=new, ignore_eos=True, seed=3)
    out = run(engine, [("n4", ids, params)])["n4"]
    assert len(out.outputs) == 4 and all(len(o.token_ids) == new for o in out.outputs)
    prompt_blocks = -(-prompt_len // BLOCK)
    gen_blocks = -(-new // BLOCK)
    assert peak <= prompt_blocks + 4 * gen_blocks + 4, peak
    private = 4 * bm.num_blocks_for(prompt_len + new)
    assert peak < private / 2, (peak, private)
