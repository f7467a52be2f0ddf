"""The sampler's fast building blocks against their plain torch definitions: the two-level CDF
inversion, numpy's argmax, and the mass above a chosen token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sample.random_draw import _block_width, _invert, _mass_above, argmax_rows


def reference_invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One long cumulative sum, searched at u times the row's total."""
    cdf = probs.double().cumsum(dim=-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 1024, 49152])
def test_invert_lands_on_the_token_whose_cdf_interval_holds_u(vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=g) ** 4
    probs[:, ::3] = 0.0  # zero-probability tokens among them
    probs[probs.sum(dim=-1) == 0, 0] = 1.0
    probs /= probs.sum(dim=-1, keepdim=True)
    u = torch.rand(64, generator=g)
    tokens = _invert(probs, u)
    assert tokens.shape == (64,) and tokens.dtype == torch.long
    assert bool((probs.gather(1, tokens[:, None]) > 0).all()), "landed on a token of probability 0"
    # The float32 sums may differ from the float64 reference by rounding only near an edge.
    ref = reference_invert(probs, u)
    assert (tokens == ref).float().mean() > 0.95


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1e-45, 1e-30, 1e-8, 0.3, 1.0, 3.0]), min_size=1, max_size=70),
       st.floats(0.0, 1.0 - 2.0**-24))
def test_invert_never_picks_a_zero_probability_token(weights, u):
    probs = torch.tensor([weights], dtype=torch.float32)
    if float(probs.sum()) == 0.0:
        probs[0, -1] = 1.0
    token = int(_invert(probs, torch.tensor([u]))[0])
    assert 0 <= token < probs.shape[1]
    assert float(probs[0, token]) > 0.0


def test_invert_draws_in_proportion_to_the_probabilities():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.2, 0.3, 0.0, 0.4] + [0.0] * 30])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(_invert(probs.expand(n, -1).contiguous(), u), minlength=probs.shape[1])
    freq = counts.double() / n
    for token, p in enumerate(probs[0].tolist()):
        assert abs(float(freq[token]) - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_block_width_is_a_power_of_two_near_the_square_root():
    for vocab, width in [(1, 16), (256, 16), (257, 32), (1024, 32), (49152, 256), (152064, 512)]:
        assert _block_width(vocab) == width


def test_argmax_rows_matches_torch_first_maximum_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("-inf")] * 4, [0.0, float("nan"), 5.0, float("nan")],
                      [float("inf"), 1.0, float("inf"), 0.0]])
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    y = torch.randn(64, 1000)
    assert argmax_rows(y).tolist() == y.argmax(dim=-1).tolist()
    assert argmax_rows(y.bfloat16()).tolist() == y.bfloat16().argmax(dim=-1).tolist()  # torch's own path


def test_mass_above_matches_the_comparison_including_infinities():
    ref = torch.tensor([[1.0, 2.0, 3.0, float("-inf")], [float("-inf")] * 4,
                        [torch.finfo(torch.float32).max, 0.0, -torch.finfo(torch.float32).max, 1.0]])
    mass = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.0, 0.0, 1.0, 0.0], [0.5, 0.2, 0.1, 0.2]])
    for col in range(4):
        chosen = ref[:, col : col + 1]
        expected = (mass * (ref > chosen)).sum(dim=-1)
        assert torch.equal(_mass_above(ref, chosen, mass), expected), col
