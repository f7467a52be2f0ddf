"""Sampler: each logits processor against a reference (HF transformers' own processors where
they exist), greedy = argmax, seeded draws reproducible whatever else is in the batch, draws
that follow the distribution, and raw logprobs / ranks / top alternatives."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.sampling_params import SamplingParams
from engine.sample.random_draw import sampling_probs
from engine.sample.sampler import Sampler, SamplingRow, score_tokens, top_candidates

VOCAB = 64


def row(prompt=(), output=(), seed=None, masked=(), **params) -> SamplingRow:
    p = SamplingParams(seed=seed, **params)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(p, list(prompt), list(output), gen, set(masked))


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


# --- contract -------------------------------------------------------------------------------


def test_logits_are_not_modified(sampler):
    logits = random_logits(4)
    before = logits.clone()
    rows = [
        row(temperature=0.0, logit_bias={1: 5.0}, masked={2}),
        row(prompt=[1, 2, 3], output=[3, 4], repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0),
        row(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, seed=1),
        row(temperature=1.0, logprobs=3),
    ]
    sampler(logits, rows)
    sampler(logits[3:], rows[3:])  # an all-random batch with nothing to adjust takes the fast path
    sampler(logits[:1], [row(temperature=0.0)])
    assert torch.equal(logits, before)


def test_non_contiguous_logits(sampler):
    """A runner may hand over a slice of a padded vocabulary."""
    padded = random_logits(3, vocab=VOCAB + 8)
    logits = padded[:, :VOCAB]
    rows = [row(temperature=0.0, prompt=[1, 2], repetition_penalty=1.2), row(temperature=0.0), row(seed=1, top_p=0.5)]
    out = sampler(logits, rows)
    assert out[1].token_id == int(logits[1].argmax())
    assert all(r.token_id < VOCAB for r in out)


def test_shape_mismatch_is_rejected(sampler):
    with pytest.raises(ValueError):
        sampler(random_logits(2), [row()])


def test_empty_batch(sampler):
    assert sampler(torch.empty(0, VOCAB), []) == []


# --- greedy and the logits processors ---------------------------------------------------------


def test_greedy_is_argmax_first_maximum(sampler):
    logits = random_logits(8)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: the first index wins, as in HF
    out = sampler(logits, [row(temperature=0.0, logprobs=0) for _ in range(8)])
    assert [r.token_id for r in out] == logits.argmax(dim=-1).tolist()
    assert out[3].token_id == 10
    assert all(r.rank == 1 for r in out)
    # NOTE: without logprobs (or best_of ranking), nothing is scored over the vocabulary.
    assert [r.logprob for r in sampler(logits[:1], [row(temperature=0.0)])] == [None]


def test_tiny_temperature_is_greedy(sampler):
    logits = random_logits(4)
    out = sampler(logits, [row(temperature=1e-6) for _ in range(4)])
    assert [r.token_id for r in out] == logits.argmax(dim=-1).tolist()


def test_logit_bias_adds(sampler):
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 5.0
    out = sampler(logits, [row(temperature=0.0, logprobs=0, logit_bias={7: 6.0, 0: -1.0, VOCAB + 5: 100.0})])
    assert out[0].token_id == 7
    adjusted = sampler.adjusted_logits(logits, [row(logit_bias={7: 6.0, 0: -1.0})])
    assert adjusted[0, 7].item() == 6.0 and adjusted[0, 0].item() == 4.0
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 7].item())  # raw


def test_masked_tokens_are_never_chosen(sampler):
    logits = torch.zeros(64, VOCAB)
    logits[:, 3] = 50.0
    logits[:, 4] = 49.0
    rows = [row(temperature=0.0, masked={3}) for _ in range(32)]
    rows += [row(temperature=2.0, seed=i, masked={3, 4, 1000}) for i in range(32)]
    out = sampler(logits, rows)
    assert all(r.token_id == 4 for r in out[:32])
    assert all(r.token_id not in (3, 4) for r in out[32:])


def test_repetition_penalty_matches_hf(sampler):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits(3)
    seqs = [([1, 2, 2, 5], [9, 1]), ([], [0, 63]), ([7] * 10, [])]
    for penalty in (0.5, 1.3, 2.0):
        rows = [row(prompt=p, output=o, repetition_penalty=penalty) for p, o in seqs]
        ours = sampler.adjusted_logits(logits, rows)
        for i, (p, o) in enumerate(seqs):
            ids = torch.tensor([p + o])
            expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
            torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties(sampler):
    logits = random_logits(2)
    rows = [
        row(prompt=[5, 5, 6], output=[1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[1], output=[], frequency_penalty=2.0, presence_penalty=2.0),  # nothing generated yet
    ]
    ours = sampler.adjusted_logits(logits, rows)
    expected = logits.clone()
    expected[0, 1] -= 3 * 0.5 + 0.25
    expected[0, 2] -= 1 * 0.5 + 0.25  # prompt tokens (5, 6) are not penalised
    torch.testing.assert_close(ours, expected)


def test_penalties_apply_in_vllm_order(sampler):
    """bias, then mask, then repetition, then frequency/presence."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = 2.0
    r = row(output=[1, 1, 3], logit_bias={1: 2.0, 3: -1.0}, repetition_penalty=2.0, frequency_penalty=1.0, masked={9})
    ours = sampler.adjusted_logits(logits, [r])[0]
    assert ours[1].item() == pytest.approx((2.0 + 2.0) / 2.0 - 2 * 1.0)
    assert ours[3].item() == pytest.approx(-1.0 * 2.0 - 1.0)
    assert ours[9].item() == float("-inf")


def test_mixed_batch_rows_are_independent(sampler):
    """Each row's settings touch only its own row."""
    logits = random_logits(3)
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, prompt=[int(logits[1].argmax())], repetition_penalty=100.0),
        row(temperature=0.0, logit_bias={0: 100.0}),
    ]
    out = sampler(logits, rows)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id != int(logits[1].argmax())
    assert out[2].token_id == 0


# --- the sampling distribution ------------------------------------------------------------------


def hf_warped(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The support HF transformers' warpers leave (temperature, top-k, top-p, min-p, in vLLM's order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return x.softmax(-1)


@pytest.mark.parametrize(
    "settings_",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=0.9, top_p=0.95),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.8, top_k=20, top_p=0.7, min_p=0.05),
        dict(temperature=1.0, top_k=1000),
    ],
    ids=str,
)
def test_sampling_probs_match_hf_warpers(settings_):
    p = SamplingParams(**settings_)
    logits = random_logits(6, vocab=2000, seed=3)
    ours = sampling_probs(logits, [p] * 6)
    expected = hf_warped(logits, p)
    assert torch.equal(ours > 0, expected > 0)  # the same support
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)


def test_top_p_with_a_wide_nucleus_falls_back_to_a_full_sort():
    """Nearly flat logits: the nucleus is far wider than the first candidates looked at."""
    p = SamplingParams(temperature=1.0, top_p=0.9)
    logits = random_logits(2, vocab=5000, seed=4, scale=0.01)
    ours = sampling_probs(logits, [p, p])
    expected = hf_warped(logits, p)
    assert torch.equal(ours > 0, expected > 0)
    assert 4000 < int((ours[0] > 0).sum()) < 5000


def test_draws_follow_the_distribution(sampler):
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0])
    n = 10000
    logits = probs.log().expand(n, -1)
    for seeded in (False, True):
        torch.manual_seed(0)
        rows = [row(temperature=1.0, seed=i if seeded else None) for i in range(n)]
        tokens = torch.tensor([r.token_id for r in sampler(logits, rows)])
        freq = torch.bincount(tokens, minlength=8).float() / n
        assert freq[5:].sum() == 0  # zero-probability tokens are never drawn
        # the standard error of each frequency is at most 0.005
        torch.testing.assert_close(freq, probs, rtol=0, atol=0.02)


def test_temperature_sharpens_and_flattens(sampler):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, -1)

    def top_share(t):
        torch.manual_seed(1)
        out = sampler(logits, [row(temperature=t) for _ in range(4000)])
        return sum(r.token_id == 0 for r in out) / 4000

    expected = {t: torch.softmax(logits[0] / t, -1)[0].item() for t in (0.5, 1.0, 2.0)}
    for t, share in expected.items():
        assert top_share(t) == pytest.approx(share, abs=0.03)


def test_top_k_one_and_tiny_top_p_are_greedy(sampler):
    logits = random_logits(16, vocab=500, seed=5)
    best = logits.argmax(-1).tolist()
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = sampler(logits, [row(temperature=1.5, **params) for _ in range(16)])
        assert [r.token_id for r in out] == best


def test_tiny_top_p_and_tight_filters_sample_the_argmax(sampler):
    """Regression: top_p=1e-300 is 0 in float32; the nucleus kept no token and gathered index -1
    (a device-side assert on a GPU). The best token always survives top-k, top-p and min-p."""
    logits = random_logits(16, vocab=500, seed=11)
    logits[::2, 7] = float("-inf")
    best = logits.argmax(-1).tolist()
    for params in (dict(top_p=1e-300), dict(top_p=5e-324), dict(min_p=1.0), dict(top_k=1),
                   dict(top_p=1e-300, min_p=1.0, top_k=1), dict(min_p=1e-300, top_p=1e-300)):
        out = sampler(logits, [row(temperature=1.0, seed=i, **params) for i in range(16)])
        assert [r.token_id for r in out] == best, params
        probs = sampling_probs(logits, [SamplingParams(temperature=1.0, **params)] * 16)
        assert torch.equal(probs.argmax(-1), torch.tensor(best)) and torch.isfinite(probs).all()


def test_top_p_keeps_every_token_tied_with_the_best():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0]])
    probs = sampling_probs(logits, [SamplingParams(top_p=1e-300)])
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1 / 3, 1 / 3, 0.0, 1 / 3]))


def test_ordinary_rows_keep_the_fast_path(sampler):
    """Rows with nothing to adjust hand back the caller's tensor: the guards add no pass."""
    logits = random_logits(3)
    rows = [row(temperature=0.0), row(temperature=0.7, top_p=0.9), row(temperature=0.0, logprobs=2)]
    assert sampler._adjusted(logits, rows, copy=False) is logits


# --- seeds ------------------------------------------------------------------------------------


def run_steps(sampler, seed: int, others: list[SamplingRow], position: int, steps: int = 6) -> list[int]:
    """Sample `steps` tokens for one seeded request sitting at `position` among `others`."""
    r = row(temperature=1.0, top_p=0.9, seed=seed)
    tokens = []
    for step in range(steps):
        rows = others[:position] + [r] + others[position:]
        logits = random_logits(len(rows), vocab=1000, seed=100 + step, scale=1.0)
        # this request's row of logits is the same at each step whatever the batch around it
        logits[position] = random_logits(1, vocab=1000, seed=step, scale=1.0)[0]
        tokens.append(sampler(logits, rows)[position].token_id)
        r.output_token_ids.append(tokens[-1])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch(sampler):
    alone = run_steps(sampler, seed=42, others=[], position=0)
    torch.manual_seed(123)
    crowd = [row(temperature=0.5), row(temperature=0.0), row(seed=7, top_k=3), row(seed=42)]
    assert run_steps(sampler, seed=42, others=crowd, position=2) == alone
    assert run_steps(sampler, seed=42, others=crowd[:1], position=1) == alone
    assert run_steps(sampler, seed=43, others=[], position=0) != alone


def test_unseeded_rows_use_the_global_rng(sampler):
    logits = random_logits(1, vocab=1000, scale=0.1)
    torch.manual_seed(5)
    a = [sampler(logits, [row()])[0].token_id for _ in range(5)]
    torch.manual_seed(5)
    b = [sampler(logits, [row()])[0].token_id for _ in range(5)]
    assert a == b and len(set(a)) > 1


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_with_rank_and_top_alternatives(sampler):
    logits = random_logits(4, vocab=200, seed=6)
    raw = torch.log_softmax(logits, -1)
    rows = [
        row(temperature=0.0, logprobs=5, logit_bias={17: 100.0}),  # forced to a low-ranked token
        row(temperature=0.3, logprobs=0, repetition_penalty=1.5, prompt=[1, 2]),
        row(temperature=1.0, top_k=3, logprobs=2, seed=1),
        row(temperature=1.0, n=1, best_of=2),  # scored for the best_of ranking
    ]
    out = sampler(logits, rows)
    assert out[0].token_id == 17
    for i, r in enumerate(out):
        assert r.logprob == pytest.approx(raw[i, r.token_id].item(), abs=1e-5)
        assert r.rank == int((raw[i] > raw[i, r.token_id]).sum()) + 1
    top5_vals, top5_ids = raw[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top5_ids.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top5_vals.tolist(), abs=1e-5)
    assert out[1].top_logprobs == []
    assert len(out[2].top_logprobs) == 2 and out[2].rank <= 3
    assert out[3].top_logprobs is None


def test_logprobs_of_half_precision_logits(sampler):
    logits = random_logits(2, vocab=300, seed=8).to(torch.bfloat16)
    out = sampler(logits, [row(temperature=0.0, logprobs=1), row(temperature=0.9, seed=3, logprobs=0)])
    assert out[0].token_id == int(logits[0].float().argmax())
    assert out[0].top_logprobs[0][0] == out[0].token_id
    assert all(math.isfinite(r.logprob) and r.logprob <= 0 for r in out)


def test_score_tokens_for_prompt_logprobs():
    logits = random_logits(5, vocab=100, seed=9)
    raw = torch.log_softmax(logits, -1)
    tokens = [3, 50, 99, 0, int(logits[4].argmax())]
    scored = score_tokens(logits, tokens, 2)
    for i, s in enumerate(scored):
        assert s.token_id == tokens[i]
        assert s.logprob == pytest.approx(raw[i, tokens[i]].item(), abs=1e-5)
        assert s.rank == int((raw[i] > raw[i, tokens[i]]).sum()) + 1
        assert [t for t, _ in s.top_logprobs] == raw[i].topk(2).indices.tolist()
    assert scored[4].rank == 1
    assert all(s.top_logprobs is None for s in score_tokens(logits, tokens))
    assert score_tokens(logits[:0], []) == []


def test_top_candidates():
    lp = torch.log_softmax(torch.tensor([0.1, 3.0, -1.0, 2.0]), -1)
    cands = top_candidates(lp, 2)
    assert [t for t, _ in cands] == [1, 3]
    assert cands[0][1] == pytest.approx(lp[1].item())
    assert len(top_candidates(lp, 10)) == 4 and top_candidates(lp, 0) == []


# --- property: a drawn token is always one the settings allow -----------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 4, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    masked=st.sets(st.integers(0, VOCAB - 1), max_size=10),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.8]),
)
def test_drawn_token_is_allowed(
    seed, temperature, top_k, top_p, min_p, masked, output, repetition_penalty, frequency_penalty
):
    sampler = Sampler()
    logits = random_logits(1, seed=seed % 1000)
    r = row(
        output=output, seed=seed, masked=masked, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
    )
    adjusted = sampler.adjusted_logits(logits, [r])
    token = sampler(logits, [r])[0].token_id
    assert token not in masked
    if r.params.is_greedy:
        assert token == int(adjusted.argmax())
    else:
        allowed = hf_warped(adjusted, r.params)[0] > 0
        assert allowed[token]


@pytest.mark.parametrize("params", [dict(top_p=0.6), dict(top_p=0.3, top_k=8), dict(top_p=0.8, min_p=0.05),
                                    dict(top_p=0.9, temperature=3.0)], ids=str)
def test_top_p_by_rejection_draws_from_the_exact_nucleus(sampler, params):
    """The sampler applies top-p by rejection (no sort of the vocabulary); its draws follow the
    exact distribution `sampling_probs` computes with the sorted cut-off, and never leave it."""
    params = {"temperature": 1.0, **params}
    logits = random_logits(1, vocab=50, seed=12, scale=1.5).expand(20000, -1)
    exact = sampling_probs(logits[:1], [SamplingParams(**params)])[0]
    torch.manual_seed(0)
    tokens = torch.tensor([r.token_id for r in sampler(logits, [row(**params) for _ in range(20000)])])
    freq = torch.bincount(tokens, minlength=50).float() / 20000
    assert (freq[exact == 0] == 0).all()  # never outside the nucleus (and the other filters)
    torch.testing.assert_close(freq, exact, rtol=0, atol=0.015)


# --- the fused CPU draw ---------------------------------------------------------------------


def test_temperature_and_top_p_rows_take_the_fused_draw_and_others_the_torch_path(sampler, monkeypatch):
    """Plain rows (temperature / top-p) are drawn by the compiled op, top-k / min-p rows by the
    torch path, in one mixed batch; every token is one its row allows."""
    from cuda_ext import ops
    from engine.sample import random_draw as random_sampling

    if not ops.draw_tokens_compiled(torch.zeros(1, 1)):
        pytest.skip("the compiled ops are not loaded")
    fused_rows, general_rows = [], []
    real_draw, real_general = ops.draw_tokens, random_sampling._general_draw
    monkeypatch.setattr(random_sampling.ops, "draw_tokens",
                        lambda logits, *a: fused_rows.append(logits.shape[0]) or real_draw(logits, *a))
    monkeypatch.setattr(random_sampling, "_general_draw",
                        lambda logits, *a: general_rows.append(logits.shape[0]) or real_general(logits, *a))
    rows = [row(temperature=0.8, top_p=0.95) for _ in range(6)] + [row(temperature=1.0, top_k=3), row(temperature=0.0),
                                                                  row(temperature=1.0, min_p=0.2)]
    logits = random_logits(len(rows))
    tokens = [r.token_id for r in sampler(logits, rows)]
    assert fused_rows[0] == 6 and general_rows[0] == 2  # the greedy row is neither
    assert tokens[7] == int(logits[7].argmax())
    assert tokens[6] in logits[6].topk(3).indices.tolist()
    for i in (0, 1, 2, 3, 4, 5, 8):
        allowed = hf_warped(sampler.adjusted_logits(logits[i : i + 1], [rows[i]]), rows[i].params)[0] > 0
        assert allowed[tokens[i]]
