"""The sampler's fused CPU draw (cuda_ext/csrc/cpu/sampling.cpp) against its pure-torch
reference (cuda_ext/reference.py `draw_tokens`): the same tokens, the same rejections, the same
undecided rows, for ordinary and extreme rows; bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops, reference
from tests.kernels.kernel_cases import require_compiled

INF = float("inf")


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def both(logits, temperature, top_p, u):
    got = ops.draw_tokens(logits, temperature, top_p, u)
    want = torch.empty_like(got)
    reference.draw_tokens(logits, temperature, top_p, u, want)
    return got, want


def near_a_boundary(logits, temperature, u, row: int) -> bool:
    """Whether u * total falls within 1e-5 (relative) of a CDF boundary of the row: there the
    kernel's partial sums (float lanes) may round to the neighbouring token."""
    x = (logits[row].double() / float(temperature[row])).nan_to_num(nan=-INF, posinf=3.4e38)
    e = torch.where(x == -INF, 0.0, (x - x.max()).exp())
    cdf = e.cumsum(0)
    target = float(u[row]) * float(cdf[-1])
    return bool(((cdf - target).abs() <= 1e-5 * float(cdf[-1])).any())


def assert_same(logits, temperature, top_p, u):
    got, want = both(logits, temperature, top_p, u)
    differ = (got != want).nonzero()[:, 0].tolist()
    assert all(near_a_boundary(logits, temperature, u, r) for r in differ), (differ, got[differ], want[differ])
    assert len(differ) <= max(2, len(got) // 100)
    return got


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 1000, 49152])
def test_matches_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64 if vocab < 49152 else 8
    logits = torch.randn(rows, vocab, generator=g) * 4
    temperature = torch.rand(rows, generator=g) * 2 + 0.05
    top_p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g))
    u = torch.rand(rows, generator=g)
    got = assert_same(logits, temperature, top_p, u)
    assert ((got >= 0) | (top_p < 1)).all()  # only a top-p test rejects (every row has finite logits)
    assert (got < vocab).all()


def test_extreme_rows():
    vocab = 100
    logits = torch.randn(10, vocab)
    logits[0] = -INF  # nothing finite: undecided
    logits[1, 3] = INF  # +inf: the largest float, it takes all the mass
    logits[2, ::2] = float("nan")  # NaN counts as -inf
    logits[3] = 0.0  # uniform
    logits[4, :50] = -INF  # half masked
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 3.4e38, 1e-30, 1.0, 1.0, 1.0])
    top_p = torch.tensor([0.9, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 1e-30, 1.0, 0.999])
    u = torch.tensor([0.5, 0.9, 0.3, 0.0, 0.99, 0.5, 0.7, 0.5, 1.0 - 2.0**-24, 0.0])
    got = assert_same(logits, temperature, top_p, u)
    assert got[0] == -1
    assert got[1] == 3
    assert got[2] % 2 == 1
    assert got[3] == 0 and got[4] >= 50
    # a tiny top_p keeps only the best token: the draw is accepted only when it drew that one
    assert got[7] in (-1, int(logits[7].argmax()))
    assert 0 <= got[8] < vocab


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.full((2000, 16), -INF)
    logits[:, 5] = 0.0
    logits[:, 11] = -3.0
    u = torch.rand(2000)
    got = ops.draw_tokens(logits, torch.ones(2000), torch.ones(2000), u)
    assert set(got.tolist()) <= {5, 11}


def test_bad_arguments_are_refused():
    logits = torch.randn(3, 10)
    ones = torch.ones(3)
    with pytest.raises(RuntimeError, match="temperature"):
        torch.ops.paged_serve.draw_tokens(logits, torch.ones(2), ones, ones, torch.empty(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="tokens"):
        torch.ops.paged_serve.draw_tokens(logits, ones, ones, ones, torch.empty(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="logits"):
        torch.ops.paged_serve.draw_tokens(logits.double(), ones, ones, ones, torch.empty(3, dtype=torch.long))
