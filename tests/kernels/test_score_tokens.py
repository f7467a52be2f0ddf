"""The sampler's compiled token scores (cuda_ext/csrc/cpu/scoring.cpp) against their pure-torch
reference (cuda_ext/reference.py `score_tokens`): the same logprobs to rounding, the same ranks,
the same top-k ids (ties by lower id) for ordinary, tied and extreme rows; rows with NaN or +inf
left to the caller (rank 0); bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops, reference
from engine.sample.sampler import score_tokens
from tests.kernels.kernel_cases import require_compiled

INF = float("inf")


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def compare(logits: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    lp, rank, ids, vals = ops.score_tokens(logits, targets, k)
    want_lp, want_rank, want_ids, want_vals = reference.score_tokens(logits, targets, k)
    assert torch.equal(rank, want_rank)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=2e-5)
    # the same values at each place; the ids too, but where values tie (then: lower id first)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    for r in range(logits.shape[0]):
        for j in range(k):
            if j + 1 < k and logits[r, ids[r, j]] == logits[r, ids[r, j + 1]]:
                assert ids[r, j] < ids[r, j + 1]


@pytest.mark.parametrize("vocab, k", [(1, 0), (1, 1), (7, 7), (64, 5), (65, 20), (1000, 3), (49152, 20)])
def test_matches_the_reference(vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    rows = 9
    logits = torch.randn(rows, vocab, generator=gen) * 4
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    compare(logits, targets, k)
    compare(logits[:, :vocab] if vocab == 1 else logits[::2], targets[::2] if vocab > 1 else targets, k)


def test_ties_and_minus_infinity():
    logits = torch.tensor([[1.0, 3.0, 3.0, -INF, 3.0, 0.5],
                           [-INF] * 6,
                           [-INF, -INF, 2.0, -INF, -INF, -INF],
                           [0.0] * 6])
    targets = torch.tensor([2, 0, 3, 5])
    compare(logits, targets, 4)
    lp, rank, ids, _ = ops.score_tokens(logits, targets, 4)
    assert ids[0].tolist()[:3] == [1, 2, 4] and rank[0].item() == 1  # 3.0 ties: the target's rank is 1
    assert lp[1].item() == -INF and lp[2].item() == -INF and rank[2].item() == 2


def test_nan_and_plus_infinity_rows_are_left_to_the_torch_path():
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = INF
    targets = torch.tensor([0, 1, 2, 3])
    _, rank, _, _ = ops.score_tokens(logits, targets, 2)
    assert rank.tolist()[1:3] == [0, 0] and rank[0] > 0 and rank[3] > 0
    # the sampler scores those rows the torch way: NaN logprobs reported as -inf
    got = score_tokens(logits, targets.tolist(), 2)
    want_lp, want_rank, want_ids, _ = reference.score_tokens(logits, targets, 2)
    assert [r.rank for r in got] == want_rank.tolist()
    assert [r.logprob for r in got][1:3] == want_lp.tolist()[1:3]
    assert [[t for t, _ in r.top_logprobs] for r in got] == want_ids.tolist()


def test_bad_arguments_are_refused():
    logits = torch.randn(3, 10)
    out = (torch.empty(3), torch.empty(3, dtype=torch.int32), torch.empty(3, 2, dtype=torch.long), torch.empty(3, 2))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.paged_serve.score_tokens(logits, torch.tensor([0, 10, 1]), 2, *out)
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.paged_serve.score_tokens(logits, torch.tensor([0, 1, 1]), 11, *out)
    with pytest.raises(RuntimeError, match="logits"):
        torch.ops.paged_serve.score_tokens(logits.double(), torch.tensor([0, 1, 1]), 2, *out)
    with pytest.raises(RuntimeError, match="rank"):
        torch.ops.paged_serve.score_tokens(logits, torch.tensor([0, 1, 1]), 2, out[0], out[1].long(), out[2], out[3])
