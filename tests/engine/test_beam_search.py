"""Beam search equals HF transformers `generate(num_beams=k, do_sample=False)` (fp32, CPU) on the
same weights, for beam widths 2 and 4, length penalties other than 1 and each early_stopping
mode; and its beams fork and drop block tables copy-on-write, leaving the pool whole and free."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.loop.tokenizer import apply_chat_template
from engine.sample import beam_search
from tests.engine.prompts import prompt_of_length

MAX_NEW = 12
QUESTIONS = ["What is the capital of France?", "Say hello in French."]
TEXTS = ["The history of the lighthouse begins with", "def fibonacci(n):"]
# (beam width k, n returned, length_penalty, early_stopping)
CONFIGS = [(2, 2, 0.6, False), (4, 2, 2.0, True), (4, 4, 0.5, "never")]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Two chat questions (answers end with EOS) and two plain texts (run to max_tokens)."""
    chats = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in chats + TEXTS]


def beam_params(k: int, n: int, lp: float, early_stopping, max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(
        n=n,
        best_of=k,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=max_tokens,
        length_penalty=lp,
        early_stopping=early_stopping,
    )


def hf_beams(hf_model, ids: list[int], k: int, n: int, lp: float, early_stopping) -> list[tuple[list[int], float]]:
    """HF's n best hypotheses: (generated token ids up to and including EOS, score)."""
    eos = hf_model.config.eos_token_id
    x = torch.tensor([ids])
    with torch.inference_mode():
        res = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=k,
            num_return_sequences=n,
            do_sample=False,
            length_penalty=lp,
            early_stopping=early_stopping,
            max_new_tokens=MAX_NEW,
            pad_token_id=eos,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
    out = []
    for j in range(n):
        gen = res.sequences[j, len(ids) :].tolist()
        if eos in gen:  # a hypothesis that ended early is padded (with EOS) to the longest
            gen = gen[: gen.index(eos) + 1]
        out.append((gen, res.sequences_scores[j].item()))
    return out


@pytest.mark.parametrize("k,n,lp,early_stopping", CONFIGS)
def test_beam_search_equals_hf(make_llm, hf_model, prompts, k, n, lp, early_stopping):
    llm = make_llm(block_size=16)
    eos = llm.engine.eos_token_id
    # All prompts in one batch: beams of different requests share steps, not blocks.
    outs = llm.generate(prompts, beam_params(k, n, lp, early_stopping))
    for p, (ids, out) in enumerate(zip(prompts, outs)):
        ref = hf_beams(hf_model, ids, k, n, lp, early_stopping)
        assert out.finished and out.error is None
        assert [o.index for o in out.outputs] == list(range(n))
        for j, (o, (ref_tokens, ref_score)) in enumerate(zip(out.outputs, ref)):
            label = f"prompt {p}, k={k}, lp={lp}, early_stopping={early_stopping}, hypothesis {j}"
            assert o.token_ids == ref_tokens, label
            assert o.cumulative_logprob / len(o.token_ids) ** lp == pytest.approx(ref_score, abs=1e-3), label
            ended = o.token_ids[-1] == eos
            assert o.finish_reason == ("stop" if ended else "length"), label
            assert ended or len(o.token_ids) == MAX_NEW, label
            assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True), label
        assert out.metrics.finish_reason == out.outputs[0].finish_reason


def test_beams_fork_and_drop_blocks_copy_on_write(make_llm, monkeypatch):
    """Step by step: the request always holds exactly k running beams; beams share blocks (the
    pool holds fewer blocks than their tables list) but each writes into a private last block,
    copied from a shared one when needed; beams that lose are freed and leave the request;
    nothing is left behind."""
    engine = make_llm(block_size=16).engine
    bm = engine.block_manager
    steps = []  # per step: (copy-on-write pairs, the beams' block tables)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        # NOTE: copies: a step's tables are the sequences' own, which change after it (a lost
        # beam's freed blocks are handed to another beam the next step)
        steps.append((out.blocks_to_copy, [list(s.block_table) for s in out.scheduled]))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    k = 4
    ids = prompt_of_length(engine.tokenizer, 40)  # two full blocks and a partial one
    engine.add_request("beams", ids, beam_params(k, 2, 0.5, False, max_tokens=10))
    group = engine.requests["beams"]
    while True:
        (out,) = engine.step()
        bm.check_integrity()
        if out.finished:
            break
        assert out.outputs == []  # no choices until the search is done
        assert len(group.seqs) == k and len(group.unfinished_seqs) == k, group.seqs
    assert len(steps) == 10 and len(steps[0][1]) == 1  # the prompt alone, then k beams
    for copies, tables in steps[1:]:
        assert len(tables) == k
        held = {b for t in tables for b in t}
        assert len(held) < sum(len(t) for t in tables)  # the prompt's blocks are shared
        assert len({t[-1] for t in tables}) == k  # each beam writes into its own last block
    assert steps[1][0], "beams forked from the prompt copy its shared last block"
    assert out.error is None and out.metrics.finish_reason == "length"
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 10 for o in out.outputs)
    assert all(s.status.finish_reason == "length" for s in group.seqs)
    assert bm.all_free()


def test_beam_search_survives_preemption(make_llm, tokenizer):
    """A pool too small for two beam requests at once (each holds a shared prompt block and two
    blocks per beam): one is preempted, recomputed with its beams sharing their prompt block,
    and both still equal the run alone."""
    params = beam_params(2, 2, 0.6, False, max_tokens=8)
    prompts = [prompt_of_length(tokenizer, 24), prompt_of_length(tokenizer, 20, offset_words=50)]
    alone = make_llm(block_size=16).generate(prompts, params)
    small = make_llm(block_size=16, max_model_len=64, num_gpu_blocks_override=4, preemption_mode="recompute")
    both = small.generate(prompts, params)
    assert small.engine.last_stats.num_preemptions_total["recompute"] >= 1
    for a, b in zip(alone, both):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def test_beam_logprobs_are_per_token_and_sum_to_the_score(make_llm, prompts):
    """Per-token logprobs (the raw model's, with their top alternatives) add up to a beam's
    cumulative logprob when nothing adjusts the logits (ignore_eos only stops EOS ending a beam)."""
    llm = make_llm(block_size=16)
    params = beam_params(2, 2, 1.0, False, max_tokens=6)
    params.logprobs, params.ignore_eos = 2, True
    out = llm.generate([prompts[0]], params)[0]
    for o in out.outputs:
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert len(o.logprobs) == 6
        assert all(t in entry and len(entry) >= 2 for t, entry in zip(o.token_ids, o.logprobs))
        total = sum(entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs))
        assert total == pytest.approx(o.cumulative_logprob, abs=1e-3)


def old_select_candidates(scores: torch.Tensor, stop_ids: set[int], k: int) -> list[tuple[int, int, float]]:
    """The rule before candidates were bounded: one flat topk of max(2, 1 + stops) * k."""
    vocab = scores.shape[1]
    values, flat = torch.topk(scores.view(-1), min(max(2, 1 + len(stop_ids)) * k, scores.numel()))
    return [(i // vocab, i % vocab, v) for i, v in zip(flat.tolist(), values.tolist())]


def test_many_stop_token_ids_keep_the_step_bounded(make_llm, prompts, monkeypatch):
    """5,000 stop token ids: no beam step ranks more than k candidates per topk, and the beams
    and hypotheses are those of the old rule (a flat topk of (1 + stops) * k candidates)."""
    llm = make_llm(block_size=16)
    k = 4
    params = SamplingParams(
        n=2, best_of=k, use_beam_search=True, temperature=0.0, max_tokens=8, stop_token_ids=list(range(2000, 7000))
    )
    sizes = []
    real_topk = torch.topk

    def counting_topk(t, n, *args, **kwargs):
        sizes.append(n)
        return real_topk(t, n, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", counting_topk)
    outs = llm.generate(prompts, params)
    monkeypatch.setattr(torch, "topk", real_topk)
    assert sizes and max(sizes) <= k, max(sizes)

    monkeypatch.setattr(beam_search, "select_candidates", old_select_candidates)
    refs = llm.generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.error is None
        got = [(o.token_ids, o.cumulative_logprob, o.finish_reason, o.stop_reason) for o in out.outputs]
        assert got == [(o.token_ids, o.cumulative_logprob, o.finish_reason, o.stop_reason) for o in ref.outputs]

