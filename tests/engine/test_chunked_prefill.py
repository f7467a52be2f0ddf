"""Chunked prefill (`enable_chunked_prefill`) on the default model: with a 64-token step budget,
prompts of 300-600 tokens are prefilled over several steps and greedy output still equals HF
transformers token for token (block sizes 16 and 1, batched with staggered arrivals, n = 2);
running requests decode in every step of a long prefill; a request preempted between its
chunks (swap or recompute) gives unchanged output; prefix caching never serves a block that a
chunked prompt has not computed yet; prompt logprobs are unchanged (such a request is never
chunked, and may exceed the budget); and a server started with the flags serves a long prompt."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.prompts import CASES as ALL_CASES
from tests.engine.prompts import prompt_of_length
from tests.engine.test_hf_equality import assert_matches
from tests.engine.test_prompt_logprobs import assert_matches_hf

BUDGET = 64
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": BUDGET}

# (prompt tokens, new tokens, word offset): prompts of prompts.CASES, with fewer new tokens
CASES = [(5, 24, 0), (333, 16, 30), (600, 12, 260), (470, 12, 120), (64, 16, 90)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _case(n: int, off: int) -> int:
    """The index in prompts.CASES of the prompt of `n` tokens at word offset `off`."""
    return next(k for k, (m, _, o) in enumerate(ALL_CASES) if (m, o) == (n, off))


@pytest.fixture(scope="module")
def cases(hf_cases):
    return [(hf_cases[_case(n, off)][0], new) for n, new, off in CASES]


@pytest.fixture(scope="module")
def reference(hf_reference):
    """The session's HF reference of these prompts (engine/conftest.py), cut to `new` tokens."""
    out = []
    for n, new, off in CASES:
        k = _case(n, off)
        assert new <= ALL_CASES[k][1], "the session's reference is shorter than this case"
        tokens, top = hf_reference[k]
        out.append((tokens[:new], top[:new]))
    return out


def step_all(engine, pending: dict[int, list[tuple[str, list[int], SamplingParams]]], check=None):
    """Step until done, adding pending[k] before step k; request id -> final output."""
    done, steps = {}, 0
    while pending or engine.has_unfinished_requests():
        for rid, ids, params in pending.pop(steps, []):
            engine.add_request(rid, ids, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        # within the budget, but for a prompt-logprob prefill that runs whole, alone
        assert (engine.last_stats.iteration_tokens <= engine.config.scheduler.max_num_batched_tokens
                or len(engine.requests) == 1 and next(iter(engine.requests.values())).params.prompt_logprobs)
        if check is not None:
            check(engine, steps)
        engine.block_manager.check_integrity()
        steps += 1
        assert steps < 5000
    return done


@pytest.mark.parametrize("block_size", [16, 1])
def test_batched_staggered_arrival_equals_hf(make_llm, cases, reference, block_size):
    """Prompts join two at a time every third step; long ones are prefilled in chunks beside the
    others' decodes. Every step stays within the budget plus one token per decode."""
    engine = make_llm(block_size=block_size, **CHUNKED).engine
    pending = {}
    for k, (ids, new) in enumerate(cases):
        pending.setdefault(3 * (k // 2), []).append((f"case-{k}", ids, greedy(new)))
    done = step_all(engine, pending)
    for k, ((ids, _), (ref, top)) in enumerate(zip(cases, reference)):
        out = done[f"case-{k}"]
        assert_matches(out.outputs[0].token_ids, ref, top, f"prompt {k} ({len(ids)} tokens), block {block_size}")
        m = out.metrics
        assert m.first_scheduled_time <= m.first_token_time and m.time_to_first_token > 0


def test_decodes_run_in_every_step_of_a_long_prefill(make_llm, cases, reference):
    """A request that is decoding gets a token in every step while a 600-token prompt is
    prefilled in 64-token steps (10 of them), and the long prompt's first token comes only
    after its last chunk; n = 2 samples fork only then, both greedy."""
    engine = make_llm(block_size=16, **CHUNKED).engine
    (short, short_new), (long, long_new) = cases[0], cases[2]
    engine.add_request("short", short, greedy(short_new))
    engine.step()
    engine.add_request("long", long, greedy(long_new, n=2))
    group = engine.requests["long"]
    steps_to_first = 0
    while not group.seqs[0].output_token_ids:
        before = len(engine.requests["short"].seqs[0].output_token_ids)
        outs = {o.request_id: o for o in engine.step()}
        steps_to_first += 1
        assert len(engine.requests["short"].seqs[0].output_token_ids) == before + 1
        assert len(group.seqs) == (2 if group.seqs[0].output_token_ids else 1)
        assert ("long" in outs) == bool(group.seqs[0].output_token_ids)  # no empty outputs
    assert steps_to_first == 13  # 12 chunks of 48 (63 tokens left, cut to a block boundary), then 24
    done = step_all(engine, {})
    for j in range(2):
        assert_matches(done["long"].outputs[j].token_ids, reference[2][0], reference[2][1], f"long sample {j}")
    assert group.metrics.queue_time < group.metrics.time_to_first_token


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_during_a_partial_prefill(make_llm, hf_model, tokenizer, mode):
    """A 32-block pool: "old" decodes beside "long" (400 tokens = 25 blocks, all allocated at
    admission), and old's next block forces "long" out between two chunks. Both outputs are
    unchanged; a swapped-out partial prefill comes back and goes on prefilling."""
    engine = make_llm(block_size=16, max_model_len=512, num_gpu_blocks_override=32, preemption_mode=mode,
                      swap_space=0.1, **CHUNKED).engine
    old, long = prompt_of_length(tokenizer, 110, 0), prompt_of_length(tokenizer, 400, 40)
    engine.add_request("old", old, greedy(20))
    while not engine.requests["old"].seqs[0].output_token_ids:
        engine.step()
    preempted_at: list[int] = []  # long's computed tokens when found preempted before its first token

    def check(engine, step):
        g = engine.requests.get("long")
        if g is None or g.seqs[0].output_token_ids:
            return
        out_of_running = g in engine.scheduler.swapped or g in engine.scheduler.waiting
        if out_of_running and g.metrics.first_scheduled_time is not None and not preempted_at:
            preempted_at.append(engine.block_manager.num_computed_tokens(g.seqs[0]))

    done = step_all(engine, {0: [("long", long, greedy(8))]}, check)
    assert preempted_at == [96 if mode == "swap" else 0]
    assert engine.scheduler.num_preemptions[mode] >= 1
    for rid, ids, new in (("old", old, 20), ("long", long, 8)):
        ref, top = hf_greedy(hf_model, ids, new)
        assert_matches(done[rid].outputs[0].token_ids, ref, top, f"{rid}, {mode}")


def test_prefix_caching_serves_only_computed_chunks(make_llm, hf_model, tokenizer):
    """"y" shares 24 blocks with "x" and arrives while x is part way through its prefill: it may
    reuse only the blocks x has computed, and both decode as HF does. A later repeat of x is
    served from the cache for all its full blocks but the last."""
    # NOTE: budget 72 with 16-token blocks: x's chunks are 64 tokens, which leaves 8 for y.
    engine = make_llm(block_size=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                      max_num_batched_tokens=72).engine
    x = prompt_of_length(tokenizer, 400, 0)
    y = x[:384] + prompt_of_length(tokenizer, 40, 200)
    done = step_all(engine, {0: [("x", x, greedy(8))], 2: [("y", y, greedy(8))]})
    assert 0 < done["y"].num_cached_tokens < 384
    assert done["y"].num_cached_tokens % 16 == 0
    refs = {rid: hf_greedy(hf_model, ids, 8) for rid, ids in (("x", x), ("y", y))}
    for rid in ("x", "y"):
        assert_matches(done[rid].outputs[0].token_ids, *refs[rid], rid)
    again = step_all(engine, {0: [("x again", x, greedy(8))]})
    assert again["x again"].num_cached_tokens == 384
    assert_matches(again["x again"].outputs[0].token_ids, *refs["x"], "x again")


def test_prompt_logprobs_are_computed_chunk_by_chunk_within_the_budget(make_llm, hf_model, tokenizer, monkeypatch):
    """A prompt-logprob request is chunked like any other: no step runs more than the budget,
    decodes keep running in every step of its prefill, and the logprobs gathered chunk by chunk
    equal HF's, short prompt beside a chunked one or long prompt past the budget alike."""
    engine = make_llm(block_size=16, **CHUNKED).engine
    short, long = prompt_of_length(tokenizer, 60, 150), prompt_of_length(tokenizer, 333, 30)
    steps = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: steps.append(schedule()) or steps[-1])
    done = step_all(engine, {0: [("long", long, greedy(4))], 1: [("p", short, greedy(2, prompt_logprobs=3))]})
    assert all(out.num_batched_tokens <= BUDGET for out in steps)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([short])).logits[0].float(), dim=-1)
    assert_matches_hf(done["p"].prompt_logprobs, short, ref, k=3, label="beside a chunked prompt")
    steps.clear()
    done = step_all(engine, {0: [("s", short, greedy(24))], 1: [("long p", long, greedy(2, prompt_logprobs=1))]})
    monkeypatch.undo()
    chunks = [[s for s in out.scheduled if s.group.request_id == "long p" and s.is_prefill] for out in steps]
    chunks = [(out, c[0].num_tokens) for out, c in zip(steps, chunks) if c]
    assert len(chunks) >= -(-333 // BUDGET) and sum(n for _, n in chunks) == 333
    assert all(out.num_batched_tokens <= BUDGET for out in steps)
    # the other stream decoded in every step of the long prefill
    assert all(any(s.group.request_id == "s" and not s.is_prefill for s in out.scheduled) for out, _ in chunks)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([long])).logits[0].float(), dim=-1)
    assert_matches_hf(done["long p"].prompt_logprobs, long, ref, k=1, label="over several chunks")
    assert not engine.has_unfinished_requests()


def test_server_serves_a_long_prompt_with_chunked_prefill(make_llm, cases):
    """`--enable-chunked-prefill --max-num-batched-tokens 64` (below --max-model-len) starts, and
    a 600-token prompt gets the text the chunked engine gives (which equals HF's, above)."""
    import openai

    from tests.server.conftest import start_server

    (ids, new) = cases[2]
    want = make_llm(block_size=16, **CHUNKED).generate([ids], greedy(new))[0].outputs[0]
    # NOTE: --dtype float32 and --quantization none as the in-process engine (tests/engine/conftest.py):
    # auto may be bf16 here, and keeps the GGUF quantized
    server = start_server("--dtype", "float32", "--quantization", "none", "--enable-chunked-prefill",
                          "--max-num-batched-tokens", "64",
                          "--max-model-len", "2048",
                          "--kv-cache-memory", "128MiB", "--no-enable-prefix-caching",
                          "--disable-uvicorn-access-log", "--log-level", "warning")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        res = client.completions.create(model=model, prompt=ids, max_tokens=new, temperature=0.0)
        assert res.usage.prompt_tokens == 600 and res.usage.completion_tokens == new
        assert res.choices[0].text == want.text
    finally:
        assert server.stop() == 0, server.log()[-4000:]
