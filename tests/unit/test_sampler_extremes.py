"""Numeric extremes: every SamplingParams field at the values a JSON number (or a Python caller)
can carry is either refused with a ValueError that names the field or sampled from without NaN,
out-of-range tokens or masked tokens; beam-search scoring and candidate selection stay defined
(and equal to the old rule) whatever the length penalty, the scores and the number of stop ids."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.core.sampling_params import SamplingParams
from engine.sample.random_draw import sampling_probs
from engine.sample.sampler import Sampler, SamplingRow, needs_scores

INF, NAN = float("inf"), float("nan")
FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
FLOAT_FIELDS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p",
                "length_penalty"]
INT_FIELDS = ["n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"]

EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-38, 1e-6, 0.3, 1.0, 1.5, 2.0, 100.0, 1e38, 1e308, -5e-324,
                  -1e-300, -1.0, -2.0, -1e308, NAN, INF, -INF, 10**30, 10**400]
EXTREME_INTS = [0, 1, 2, 16, -1, -2, 10**30, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, True, 1.5, NAN, "3"]


def extreme_params():
    """kwargs for SamplingParams: a few fields, each at an extreme (valid or not)."""
    floats = st.fixed_dictionaries({}, optional={f: st.sampled_from(EXTREME_FLOATS) for f in FLOAT_FIELDS})
    ints = st.fixed_dictionaries({}, optional={f: st.sampled_from(EXTREME_INTS) for f in INT_FIELDS})
    bias = st.dictionaries(st.sampled_from([0, 1, 7, 499, 10**30, -1]), st.sampled_from([-100.0, -1e-300, 0.0, 100.0]),
                           max_size=4)
    stop_ids = st.lists(st.sampled_from([0, 3, 49, 10**30]), max_size=3)
    return st.tuples(floats, ints, bias, stop_ids).map(
        lambda t: {**t[0], **t[1], "logit_bias": t[2], "stop_token_ids": t[3]}
    )


# Values each field accepts, at their extremes: the sampler must make them well defined.
VALID_EXTREMES = {
    "temperature": [0.0, 0.0, 0.0, 5e-324, 1e-300, 1e-6, 1e-5, 0.3, 1.0, 2.0, 1e38, 1e308],
    "top_p": [5e-324, 1e-300, 1e-38, 1e-6, 0.5, 0.999999999, 1.0],
    "min_p": [0.0, 5e-324, 1e-300, 1e-6, 0.5, 1.0],
    "top_k": [-1, 0, 1, 2, 49, 500, 10**30, 2**63 - 1],
    "repetition_penalty": [5e-324, 1e-300, 1e-38, 0.5, 1.0, 2.0, 1e38, 1e308],
    "presence_penalty": [-2.0, -5e-324, 0.0, 1e-300, 2.0],
    "frequency_penalty": [-2.0, -5e-324, 0.0, 1e-300, 2.0],
    "seed": [None, 0, -1, 2**63 - 1, -(2**63)],
    "logprobs": [None, 0, 5, 10**30],
}


def valid_extreme_params():
    fields = st.fixed_dictionaries({}, optional={f: st.sampled_from(v) for f, v in VALID_EXTREMES.items()})
    bias = st.dictionaries(st.sampled_from([0, 1, 7, 499, 10**30, -1]), st.sampled_from([-100.0, -1e-300, 0.0, 100.0]),
                           max_size=4)
    return st.tuples(fields, bias).map(lambda t: {**t[0], "logit_bias": t[1]})


def build(kwargs) -> SamplingParams | None:
    """The params, or None when they are refused with a ValueError that starts with a field name."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        assert first in FIELDS, f"message does not start with a field name: {e}"
        return None


def random_logits(gen: torch.Generator, vocab: int, scale: float, neg_inf: float) -> torch.Tensor:
    """One row: normal logits times `scale`, a fraction `neg_inf` of them -inf (all for 1.0)."""
    logits = torch.randn(1, vocab, generator=gen) * scale
    logits[torch.rand(1, vocab, generator=gen) < neg_inf] = -INF
    if neg_inf >= 1.0:
        logits.fill_(-INF)
    return logits


# --- SamplingParams ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, derandomize=True)
@given(kwargs=extreme_params())
def test_extreme_params_are_refused_by_name_or_clean(kwargs):
    """No TypeError / OverflowError; a refusal names its field; what is accepted is plain and finite."""
    p = build(kwargs)
    if p is None:
        return
    for name in FLOAT_FIELDS:
        value = getattr(p, name)
        assert type(value) is float and math.isfinite(value), (name, value)
    for name in INT_FIELDS:
        value = getattr(p, name)
        assert value is None or type(value) is int, (name, value)
    if p.seed is not None:
        assert -(2**63) <= p.seed < 2**63
    assert all(type(v) is float and math.isfinite(v) for v in p.logit_bias.values())
    assert all(type(t) is int for t in p.stop_token_ids)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", NAN), ("top_p", NAN), ("min_p", NAN), ("repetition_penalty", INF), ("length_penalty", NAN),
     ("length_penalty", -INF), ("presence_penalty", NAN), ("temperature", INF), ("top_k", 2.0), ("top_k", True),
     ("n", 1.0), ("best_of", True), ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1.0), ("max_tokens", 1.5),
     ("min_tokens", NAN), ("logprobs", True), ("prompt_logprobs", 0.5), ("temperature", 10**400)],
    ids=lambda v: repr(v)[:20],
)
def test_bad_numbers_are_refused_with_the_field_name(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field + " "), str(e.value)


def test_an_integer_too_long_to_print_is_refused_by_name():
    for field in ("n", "seed", "top_k", "max_tokens"):
        with pytest.raises(ValueError, match=f"^{field} .*more than 4300 digits"):
            SamplingParams(**{field: -(10**5000)})


@pytest.mark.parametrize(
    "bias,message", [({"x": 1.0}, "logit_bias keys"), ({1.5: 1.0}, "logit_bias keys"), ({1: NAN}, "logit_bias"),
                     ({1: "2"}, "logit_bias"), ({1: 101.0}, "logit_bias values")],
)
def test_bad_logit_bias_is_refused_by_name(bias, message):
    with pytest.raises(ValueError, match="^" + message):
        SamplingParams(logit_bias=bias)


def test_extreme_but_meaningful_values_are_accepted():
    for kwargs in (dict(temperature=1e308), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e308),
                   dict(min_p=1e-300), dict(top_p=1e-300), dict(top_p=5e-324), dict(length_penalty=-1e308),
                   dict(seed=-(2**63)), dict(seed=2**63 - 1), dict(top_k=10**30), dict(max_tokens=10**30)):
        SamplingParams(**kwargs)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.sampled_from([0, 1, -1, 42, 2**32, 2**63 - 1, -(2**63)]) | st.integers(-(2**63), 2**63 - 1),
       index=st.sampled_from([0, 1, 2, 16, 2**63, 2**64, 2**70, -1, -(2**64)]) | st.integers(0, 64))
def test_derive_seed_is_always_accepted_by_manual_seed(seed, index):
    from engine.core.sampling_params import derive_seed

    s = derive_seed(seed, index)
    torch.Generator().manual_seed(s)  # never raises
    if index == 0:
        assert s == seed  # seeded outputs of ordinary seeds do not change
    if 0 <= index <= 2**63:
        assert s == seed + index


# --- the sampler ---------------------------------------------------------------------------------


def check_probs(probs: torch.Tensor) -> None:
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert (probs > 0).any(dim=-1).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[0]), rtol=0, atol=1e-4)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    source=st.tuples(st.just(True), valid_extreme_params()) | st.tuples(st.just(False), extreme_params()),
    vocab=st.integers(50, 500),
    data_seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 1.0, 10.0, 1e4, 1e30]),
    neg_inf=st.sampled_from([0.0, 0.0, 0.2, 0.95, 1.0]),
    masked=st.sets(st.integers(0, 520), max_size=40) | st.just(frozenset(range(500))),
    prompt=st.lists(st.integers(0, 520), max_size=12),
    output=st.lists(st.integers(0, 520), max_size=12),
    index=st.sampled_from([0, 1, 16]),
)
def test_sampler_with_extreme_params(source, vocab, data_seed, scale, neg_inf, masked, prompt, output, index):
    """A valid token, never a masked one unless all are, a finite logprob unless the raw model
    said -inf, and clean probabilities to draw from."""
    from engine.core.sampling_params import derive_seed

    valid, kwargs = source
    p = build(kwargs)
    if p is None:
        assert not valid, f"refused: {kwargs}"
        event("refused")
        return
    gen = torch.Generator().manual_seed(data_seed)
    raw = random_logits(gen, vocab, scale, neg_inf)
    seeded = torch.Generator().manual_seed(derive_seed(p.seed, index)) if p.seed is not None else None
    row = SamplingRow(p, prompt, output, seeded, set(masked))
    sampler = Sampler()
    adjusted = sampler.adjusted_logits(raw, [row])
    assert not adjusted.isnan().any() and not (adjusted == INF).any()

    result = sampler(raw, [row])[0]
    assert 0 <= result.token_id < vocab
    all_masked = bool((adjusted == -INF).all())
    event(f"greedy={p.is_greedy}, all masked={all_masked}")
    if all_masked:
        assert result.token_id == int(raw.argmax())
    else:
        assert adjusted[0, result.token_id] > -INF
    if p.is_greedy and not all_masked:
        assert result.token_id == int(adjusted.argmax())
    if not needs_scores(p):  # nothing to score: no vocabulary pass
        assert result.logprob is None and result.rank is None
    else:
        assert math.isfinite(result.logprob) or (result.logprob == -INF and raw[0, result.token_id] == -INF)
        assert not math.isnan(result.logprob) and result.rank >= 1

    if not p.is_greedy:
        probs = sampling_probs(adjusted, [p])
        check_probs(probs)
        if not all_masked:
            assert probs[0, result.token_id] > 0  # drawn from what the settings allow
            assert (probs[0][adjusted[0] == -INF] == 0).all()


def test_huge_temperature_is_uniform_over_the_unmasked():
    logits = torch.tensor([[5.0, -3.0, -INF, 0.5, -INF, 40.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=1e308)])
    torch.testing.assert_close(probs[0], torch.tensor([0.25, 0.25, 0.0, 0.25, 0.0, 0.25]))


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 1e308])
def test_extreme_repetition_penalty_gives_no_nan_or_inf(penalty):
    logits = torch.tensor([[3.0, 0.0, -2.0, -INF, 1.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=penalty, temperature=0.0), [0, 1, 2, 3], [], None)
    adjusted = Sampler().adjusted_logits(logits, [row])
    assert not adjusted.isnan().any() and not (adjusted == INF).any()
    assert adjusted[0, 3] == -INF and adjusted[0, 4] == 1.0  # unseen tokens are untouched
    token = Sampler()(logits, [row])[0].token_id
    assert token == (0 if penalty < 1 else 4)  # a penalty near 0 favours seen positive logits


def test_every_token_masked_falls_back_to_the_raw_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]] * 2)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=1, logprobs=0), [], [], torch.Generator().manual_seed(1),
                        {0, 1, 2, 3}) for t in (0.0, 1.0)]
    out = Sampler()(logits, rows)
    assert [r.token_id for r in out] == [1, 1]
    assert all(math.isfinite(r.logprob) for r in out)


def test_all_neg_inf_raw_row_is_defined():
    logits = torch.full((2, 8), -INF)
    rows = [SamplingRow(SamplingParams(temperature=t, top_p=0.5, logprobs=2), [], [], None) for t in (0.0, 1.0)]
    out = Sampler()(logits, rows)
    assert all(0 <= r.token_id < 8 and r.logprob == -INF for r in out)
    assert all(v == -INF for r in out for _, v in r.top_logprobs)
    check_probs(sampling_probs(logits, [rows[1].params]))


# --- beam search ---------------------------------------------------------------------------------


def old_normalized(score: float, length: int, length_penalty: float) -> float:
    return (torch.tensor(score, dtype=torch.float32) / (length**length_penalty)).item()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    score=st.sampled_from([0.0, -0.0, -1e-45, -1.5, -37.25, -1e38, -3.4e38, -INF]) | st.floats(-1e4, 0.0),
    length=st.sampled_from([1, 2, 3, 100, 10**6]),
    length_penalty=st.sampled_from([0.0, 1.0, -1.0, 0.6, 2.0, 5e-324, 1e3, -1e3, 1e308, -1e308, 1e-300]),
)
def test_normalized_never_raises_nor_returns_nan(score, length, length_penalty):
    from engine.sample.beam_search import _normalized

    out = _normalized(score, length, length_penalty)
    assert not math.isnan(out)
    try:
        old = old_normalized(score, length, length_penalty)
    except OverflowError:
        return
    if not math.isnan(old):
        assert out == old and math.copysign(1, out) == math.copysign(1, old)  # bit-identical


def old_select(scores: torch.Tensor, stop_ids: set[int], k: int) -> list[tuple[int, int, float]]:
    """The selection before the fix: one flat topk of max(2, 1 + stops) * k candidates."""
    vocab = scores.shape[1]
    num_keep = min(max(2, 1 + len(stop_ids)) * k, scores.numel())
    values, flat = torch.topk(scores.view(-1), num_keep)
    return [(i // vocab, i % vocab, v) for i, v in zip(flat.tolist(), values.tolist())]


def choose(candidates, stop_ids: set[int], k: int, ends_by_length: bool):
    """beam_search_step's loop: (hypotheses, next beams) as (row, token, score)."""
    hyps, beams = [], []
    for rank, c in enumerate(candidates):
        if c[1] in stop_ids or ends_by_length:
            if rank < k:
                hyps.append(c)
        elif len(beams) < k:
            beams.append(c)
    return hyps, beams


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 6),
    vocab=st.integers(2, 300),
    num_stop=st.sampled_from([0, 1, 2, 5, 50, 299, 400]),
    neg_inf=st.sampled_from([0.0, 0.5, 1.0]),
    scale=st.sampled_from([1.0, 1e30, 3e38]),
    ends_by_length=st.booleans(),
)
def test_beam_candidates_equal_the_old_rule(seed, k, vocab, num_stop, neg_inf, scale, ends_by_length):
    from engine.sample.beam_search import select_candidates

    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, k + 1, (1,), generator=gen))
    scores = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)
    scores[scores.isnan() | (torch.rand(rows, vocab, generator=gen) < neg_inf)] = -INF
    stop_ids = set(torch.randperm(vocab + 100, generator=gen)[:num_stop].tolist())  # some outside the vocabulary
    new_candidates = select_candidates(scores, stop_ids, k)
    assert len(new_candidates) <= 2 * k and all(not math.isnan(c[2]) for c in new_candidates)
    new = choose(new_candidates, stop_ids, k, ends_by_length)
    old = choose(old_select(scores, stop_ids, k), stop_ids, k, ends_by_length)

    is_stop = torch.tensor([t in stop_ids for t in range(vocab)])
    finite = torch.isfinite(scores)
    distinct = scores[finite].unique().numel() == int(finite.sum())
    if distinct and int(finite.sum()) >= k and (ends_by_length or int((finite & ~is_stop).sum()) >= k):
        assert new == old  # what the loop uses has no ties: the same beams and hypotheses, in order
        return
    # Equal scores (-inf) may be taken in another order; the beams are still the best that continue.
    hyps, beams = new
    if not ends_by_length:
        best_continuing = scores[:, ~is_stop].flatten().sort(descending=True).values[:k].tolist()
        assert [c[2] for c in beams] == best_continuing
    kth = scores.flatten().sort(descending=True).values[min(k, scores.numel()) - 1].item()
    assert len(hyps) <= k and all(c[2] >= kth for c in hyps)


def test_beam_candidate_work_does_not_grow_with_stop_ids(monkeypatch):
    from engine.sample.beam_search import select_candidates

    k, vocab = 4, 8000
    scores = torch.log_softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(0)), dim=-1)
    topk_sizes = []
    real_topk = torch.topk

    def counting_topk(t, n, *args, **kwargs):
        topk_sizes.append(n)
        return real_topk(t, n, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", counting_topk)
    for stop in (set(), {5}, set(range(0, 10000, 2))):  # 5,000 stop ids inside the vocabulary
        topk_sizes.clear()
        candidates = select_candidates(scores, stop, k)
        assert topk_sizes and max(topk_sizes) <= k, topk_sizes
        assert len(candidates) <= 2 * k
