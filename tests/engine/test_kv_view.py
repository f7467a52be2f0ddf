"""What the dashboard reads (engine/kv/kv_view.py) on the tiny dummy model: one request's block
tables, the list of requests holding blocks, and the event log of copy-on-writes and
preemptions. The tables are checked against the block manager's own state."""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine

BS = 16
PROMPT = [(5 * k) % 900 + 3 for k in range(40)]  # two full blocks and a partial third


def engine(**overrides) -> LLMEngine:
    args = dict(model="tiny-4kv", load_format="dummy", max_model_len=256, block_size=BS,
                num_gpu_blocks_override=64, swap_space=0.01, enable_prefix_caching=True)
    args.update(overrides)
    return LLMEngine(EngineArgs(**args).create_engine_config())


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 3, "max_tokens": 12, "ignore_eos": True, **kw})


def test_parallel_samples_share_their_prompt_blocks_then_leave_no_table():
    e = engine()
    e.add_request("r", PROMPT, params(n=3))
    e.step()  # the prefill: the three samples fork from it and share all its blocks
    tables = e.request_blocks("r")
    assert tables["status"] == "running" and len(tables["sequences"]) == 3
    assert [s["blocks"] for s in tables["sequences"]] == [tables["sequences"][0]["blocks"]] * 3
    assert all(s["ref_counts"] == [3, 3, 3] for s in tables["sequences"])
    assert e.block_map()["events"] == []

    e.step()  # each writes its next token into the shared partial block: copy-on-write
    tables = e.request_blocks("r")
    rows = [s["blocks"] for s in tables["sequences"]]
    assert rows[0][:2] == rows[1][:2] == rows[2][:2]
    assert all(s["ref_counts"][:2] == [3, 3] for s in tables["sequences"])
    assert len({r[2] for r in rows}) == 3 and all(s["ref_counts"][2] == 1 for s in tables["sequences"])
    for s in tables["sequences"]:
        seq = next(q for q in e.requests["r"].seqs if q.index == s["index"])
        assert s["blocks"] == e.block_manager.tables[seq.seq_id].tolist() and s["pool"] == "device"
    cows = [ev for ev in e.block_map()["events"] if ev["kind"] == "cow"]
    # two of the three copy; the last one left holding the block writes into it in place
    assert len(cows) == 2 and {ev["logical_block"] for ev in cows} == {2}
    (shared,) = {ev["src"] for ev in cows}  # the block they all held
    assert {ev["dst"] for ev in cows} | {shared} == {r[2] for r in rows}
    listed = e.block_map()["requests"]
    assert listed == [{"request_id": "r", "status": "running", "num_seqs": 3, "num_blocks": 2 + 3,
                       "beam_search": False}]
    while e.has_unfinished_requests():
        e.step()
    assert e.request_blocks("r") is None and e.block_map()["requests"] == []


def test_a_prefix_cache_hit_is_marked_in_the_table():
    e = engine()
    e.add_request("first", PROMPT, params(n=1, max_tokens=2))
    while e.has_unfinished_requests():
        e.step()
    e.add_request("second", PROMPT, params(n=1, max_tokens=4))
    e.step()
    (seq,) = e.request_blocks("second")["sequences"]
    assert seq["prefix_hit"] == [True, True, False]


def test_beams_copy_on_write_and_the_log_says_where():
    e = engine()
    e.add_request("beams", PROMPT, SamplingParams(use_beam_search=True, best_of=3, n=1, temperature=0,
                                                  max_tokens=20, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    cows = [ev for ev in e.block_map()["events"] if ev["kind"] == "cow"]
    assert cows, e.block_map()["events"]
    for ev in cows:
        assert ev["request_id"] == "beams" and ev["src"] != ev["dst"]
        assert ev["logical_block"] is not None and 0 <= ev["logical_block"] <= (len(PROMPT) + 20) // BS
    ids = [ev["id"] for ev in e.block_map()["events"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_preemptions_are_logged_and_the_log_is_bounded():
    # 10 blocks: two requests that each grow to 6 blocks cannot run together.
    e = engine(num_gpu_blocks_override=10, max_model_len=96, swap_space=0.01, enable_prefix_caching=False,
               preemption_mode="swap")
    e.add_request("old", PROMPT, params(max_tokens=50))
    e.add_request("new", PROMPT[::-1], params(max_tokens=50))
    seen_swapped = False
    while e.has_unfinished_requests():
        e.step()
        view = e.request_blocks("new")
        if view is not None and view["status"] == "swapped":
            seen_swapped = True
            assert all(s["pool"] == "cpu" and s["blocks"] for s in view["sequences"])
    kinds = [(ev["kind"], ev["request_id"]) for ev in e.block_map()["events"]]
    assert ("swap_out", "new") in kinds and ("swap_in", "new") in kinds and seen_swapped
    log = e.scheduler.events
    for _ in range(500):
        log.record("park", "x", seq_index=1)
    assert len(log.recent()) == 64
