"""Prompt logprobs (`SamplingParams.prompt_logprobs = k`) on the default model: each prompt
token's logprob and its k best alternatives equal HF transformers' log_softmax over the same
prompt (fp32, CPU), alone and in a batch beside decodes; they are complete with prefix caching
on and a repeated prompt, computed once across recompute preemptions, shared by n / best_of /
beam samples, and present on a request's first output; and the LM head sees at most a chunk of
prompt rows at a time, whatever the prompt's length."""

from __future__ import annotations

import pytest
import torch

from engine.core import step as scheduler_output
from engine.core.sampling_params import SamplingParams
from tests.engine.prompts import prompt_of_length

TOL = 1e-3  # absolute, on logprobs in fp32
NEAR_TIE = 1e-4  # top-k ids may swap where the reference's values are this close
K = 3


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt_of_length(tokenizer, n, off) for n, off in [(5, 0), (37, 40), (130, 150)]]


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """Per prompt: HF's log_softmax [len(prompt), vocab]; row i - 1 scores prompt token i."""
    with torch.inference_mode():
        return [torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": K, **kw})


def assert_matches_hf(got, ids: list[int], ref: torch.Tensor, k: int = K, label: str = "") -> None:
    assert got is not None and len(got) == len(ids), f"{label}: {None if got is None else len(got)} entries"
    assert got[0] is None
    for i in range(1, len(ids)):
        entry, row, tok = got[i], ref[i - 1], ids[i]
        where = f"{label} position {i}"
        assert next(iter(entry)) == tok, f"{where}: the prompt token comes first"
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=TOL), where
        v = row[tok].item()  # our rank may differ only among tokens within TOL of it
        assert int((row > v + TOL).sum()) + 1 <= entry[tok].rank <= int((row > v - TOL).sum()), where
        top_vals, top_ids = row.topk(k)
        ours = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= k)
        assert len(entry) in (k, k + 1) and [r for r, _, _ in ours] == list(range(1, k + 1)), where
        for (rank, tid, lp), want_id, want_lp in zip(ours, top_ids.tolist(), top_vals.tolist()):
            assert lp == pytest.approx(want_lp, abs=TOL), f"{where} rank {rank}"
            if tid != want_id:  # only a near-tie in the reference may swap two alternatives
                assert abs(row[tid].item() - want_lp) < NEAR_TIE, f"{where} rank {rank}: {tid} vs {want_id}"


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: dict[str, int] | None = None):
    """Step the engine by hand; returns ({id: first output}, {id: final output}). `stagger`
    adds a request at that step instead of at once."""
    stagger = stagger or {}
    first, final, steps = {}, {}, 0
    pending = dict(requests)
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if stagger.get(r, 0) <= steps]:
            ids, p = pending.pop(rid)
            engine.add_request(rid, ids, p)
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.finished:
                final[out.request_id] = out
        engine.block_manager.check_integrity()
        steps += 1
    return first, final


def test_prompt_logprobs_equal_hf(make_llm, prompts, reference):
    llm = make_llm(block_size=16)
    for k, (ids, ref) in enumerate(zip(prompts, reference)):
        out = llm.generate([ids], params())[0]
        assert_matches_hf(out.prompt_logprobs, ids, ref, label=f"prompt {k} alone")
    zero = llm.generate([prompts[1]], params(prompt_logprobs=0))[0].prompt_logprobs
    assert all(len(e) == 1 for e in zero[1:])
    plain = llm.generate([prompts[1]], params(prompt_logprobs=None))[0]
    assert plain.prompt_logprobs is None


def test_batched_beside_decodes(make_llm, prompts, reference):
    """Two prompt-logprob prefills join a running decode in one step (their extra logit rows
    follow every sequence's last row); a third request asks for none."""
    engine = make_llm(block_size=16).engine
    requests = {
        "plain": (prompts[2], params(prompt_logprobs=None, max_tokens=6)),
        "a": (prompts[0], params(prompt_logprobs=2)),
        "b": (prompts[2], params()),
        "c": (prompts[1], params()),
    }
    first, final = run(engine, requests, stagger={"a": 2, "b": 2, "c": 4})
    assert final["plain"].prompt_logprobs is None
    for rid, k in [("a", 0), ("b", 2), ("c", 1)]:
        assert first[rid].prompt_logprobs is final[rid].prompt_logprobs
        assert_matches_hf(first[rid].prompt_logprobs, prompts[k], reference[k], k=requests[rid][1].prompt_logprobs,
                          label=f"request {rid}")


def test_prefix_caching_repeated_prompt_is_complete(make_llm, prompts, reference):
    """A cached prompt does not shorten prompt logprobs: the request computes it whole (and
    still publishes its blocks, so a plain request after it hits the cache)."""
    engine = make_llm(block_size=16, enable_prefix_caching=True).engine
    ids, ref = prompts[2], reference[2]
    salt = "prompt-logprobs-test"  # NOTE: no blocks cached by other tests are reused
    _, warm = run(engine, {"warm": (ids, params(prompt_logprobs=None, cache_salt=salt))})
    _, got = run(engine, {"x": (ids, params(cache_salt=salt)), "y": (ids, params(cache_salt=salt))},
                 stagger={"y": 3})
    for rid in ("x", "y"):
        assert got[rid].num_cached_tokens == 0
        assert_matches_hf(got[rid].prompt_logprobs, ids, ref, label=f"cached prompt, request {rid}")
    _, after = run(engine, {"z": (ids, params(prompt_logprobs=None, cache_salt=salt))})
    assert after["z"].num_cached_tokens >= 16 * (len(ids) // 16) - 16


def test_computed_once_across_recompute_preemption(make_llm):
    """The preemption tests' tiny pool: 16 short prompts grow until >= 20 recompute
    preemptions. Each request's prompt logprobs are those of a run with ample memory, of the
    prompt's length, and the very list given on its first output (never recomputed)."""
    tiny = make_llm(block_size=4, max_model_len=64, num_gpu_blocks_override=17, preemption_mode="recompute",
                    swap_space=0.01)
    ample = make_llm(block_size=4, max_model_len=64)
    prompts = [prompt_of_length(tiny.tokenizer, 4 + k % 5, 13 * k) for k in range(16)]
    p = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, prompt_logprobs=1)
    before = tiny.engine.scheduler.num_preemptions["recompute"]
    first, final = run(tiny.engine, {f"r{k}": (ids, p) for k, ids in enumerate(prompts)})
    assert tiny.engine.scheduler.num_preemptions["recompute"] - before >= 20
    preempted = [rid for rid, out in final.items() if out.metrics.num_preemptions > 0]
    assert preempted
    # NOTE: prompt logprobs do not depend on what is generated: one token is enough here.
    want = ample.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for k, w in enumerate(want):
        got = final[f"r{k}"].prompt_logprobs
        assert got is first[f"r{k}"].prompt_logprobs and len(got) == len(prompts[k]) and got[0] is None
        for g, e in zip(got[1:], w.prompt_logprobs[1:]):
            assert set(g) == set(e)
            assert all(g[t].logprob == pytest.approx(e[t].logprob, abs=TOL) for t in g)


def test_shared_by_samples_and_beams(make_llm, prompts, reference):
    engine = make_llm(block_size=16).engine
    ids, ref = prompts[1], reference[1]
    requests = {
        "n3": (ids, params(n=3, temperature=1.0, seed=3, max_tokens=3)),
        "best_of": (ids, params(n=2, best_of=3, temperature=1.0, seed=5, max_tokens=3)),
        "beams": (ids, params(n=2, use_beam_search=True, max_tokens=3)),
    }
    first, final = run(engine, requests)
    for rid in requests:
        got = first[rid].prompt_logprobs
        assert got is final[rid].prompt_logprobs, f"{rid}: computed once, on the first output"
        assert len(final[rid].outputs) == requests[rid][1].n
        assert_matches_hf(got, ids, ref, label=rid)


def test_lm_head_rows_bounded_by_chunk(make_llm, prompts, reference, monkeypatch):
    """Peak memory is O(chunk x vocab), not O(prompt x vocab): with chunks of 16 rows, two
    prompts of 130 and 37 tokens in one step (165 prompt rows, so chunks span both) never give
    the LM head more than 16 rows at once, and their logprobs still equal HF's."""
    chunk = 16
    monkeypatch.setattr(scheduler_output, "PROMPT_LOGPROB_CHUNK_ROWS", chunk)
    llm = make_llm(block_size=16)
    model = llm.engine.executor.runner.model
    calls: list[int] = []
    compute_logits = model.compute_logits

    def recording(hidden):
        calls.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    ids = [prompts[2], prompts[1]]
    outs = llm.generate(ids, [params(), params(prompt_logprobs=1)])
    rows = len(ids[0]) - 1 + len(ids[1]) - 1
    assert rows > 2 * chunk
    assert max(calls) <= max(chunk, len(ids)), calls
    assert sum(calls) >= rows and len(calls) >= rows // chunk, calls
    assert_matches_hf(outs[0].prompt_logprobs, ids[0], reference[2], label="130 tokens, chunks of 16")
    assert_matches_hf(outs[1].prompt_logprobs, ids[1], reference[1], k=1, label="37 tokens, chunks of 16")


def test_chunks_of_random_sizes_equal_the_one_step_result(make_llm, tokenizer):
    """Seeded walk: prompt-logprob requests beside plain ones on a small pool (recompute
    preemption, prefix caching on), each step with a random token budget, so prompts are cut
    into chunks of random sizes, preempted part way and recomputed, with prefix-cache hits for
    the positions already scored. Every request's prompt logprobs equal those of an engine that
    computes each prompt in one step (fp32 tolerance) and name the same top-k ids; each of the
    walk's situations occurs."""
    import dataclasses
    import random

    one_step = make_llm(block_size=4, max_model_len=160, enable_chunked_prefill=False)
    walker = make_llm(block_size=4, max_model_len=160, enable_chunked_prefill=True, enable_prefix_caching=True,
                      num_gpu_blocks_override=42, preemption_mode="recompute", max_num_seqs=4,
                      max_num_batched_tokens=64)
    engine = walker.engine
    bm, config = engine.block_manager, engine.scheduler.config
    seen = {"chunked": 0, "preempted": 0, "hits after a preemption": 0}
    admitted: list[tuple[str, int]] = []  # (request, tokens the cache served) per admission
    allocate = bm.allocate

    def recording(group, *args, **kwargs):
        allocate(group, *args, **kwargs)
        if group.prompt_logprobs_pending:
            admitted.append((group.request_id, bm.num_computed_tokens(group.seqs[0])))

    try:
        bm.allocate = recording
        for seed in range(4):
            rng = random.Random(seed)
            requests: dict[str, tuple[list[int], SamplingParams]] = {}
            for j in range(3):
                ids = prompt_of_length(tokenizer, rng.randint(24, 110), rng.randint(0, 300))
                requests[f"{seed}-lp{j}"] = (ids, SamplingParams(temperature=0, max_tokens=rng.randint(1, 4),
                                                                 ignore_eos=True, prompt_logprobs=rng.randint(0, 4)))
                if j < 2:  # a plain request with the same prompt: its blocks are cached
                    requests[f"{seed}-plain{j}"] = (ids, SamplingParams(temperature=0, max_tokens=rng.randint(8, 40),
                                                                        ignore_eos=True))
            stagger = {rid: rng.randint(0, 6) for rid in requests}
            preempted_before = engine.scheduler.num_preemptions["recompute"]
            admitted.clear()
            pending, final, step = dict(requests), {}, 0
            while pending or engine.has_unfinished_requests():
                for rid in [r for r in pending if stagger[r] <= step]:
                    engine.add_request(rid, *pending.pop(rid))
                engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=rng.randint(8, 48))
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                bm.check_integrity()
                step += 1
            engine.scheduler.config = config
            assert bm.all_free()
            seen["preempted"] += engine.scheduler.num_preemptions["recompute"] > preempted_before
            by_request: dict[str, list[int]] = {}
            for rid, cached in admitted:
                by_request.setdefault(rid, []).append(cached)
            seen["hits after a preemption"] += sum(any(c > 0 for c in v[1:]) for v in by_request.values())
            lp_ids = [rid for rid in requests if "-lp" in rid]
            want = one_step.generate([requests[r][0] for r in lp_ids],
                                     [dataclasses.replace(requests[r][1], max_tokens=1) for r in lp_ids])
            for rid, w in zip(lp_ids, want):
                ids, p = requests[rid]
                got = final[rid].prompt_logprobs
                seen["chunked"] += final[rid].metrics.num_preemptions == 0 and len(ids) > 48
                assert got is not None and len(got) == len(ids) and got[0] is None, rid
                for pos, (g, e) in enumerate(zip(got[1:], w.prompt_logprobs[1:]), start=1):
                    tok = ids[pos]
                    assert next(iter(g)) == tok and g[tok].logprob == pytest.approx(e[tok].logprob, abs=1e-4), (rid, pos)
                    top_g = [t for t, lp in g.items() if lp.rank <= p.prompt_logprobs]
                    top_e = [t for t, lp in e.items() if lp.rank <= p.prompt_logprobs]
                    if top_g != top_e:  # only near-ties may swap
                        assert all(abs(g[t].logprob - e[t].logprob) < 1e-4 for t in set(top_g) & set(top_e)), (rid, pos)
                        assert len(set(top_g) ^ set(top_e)) <= 2 and all(
                            abs(lp.logprob - g[top_g[-1]].logprob) < NEAR_TIE for t, lp in g.items() if t in top_g[-1:])
    finally:
        bm.allocate = allocate
        engine.scheduler.config = config
    assert all(seen.values()), seen
