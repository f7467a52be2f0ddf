"""The skewed length sampler and the built-in corpus."""

import random
from collections import Counter

import pytest

from benchmarks.workload import TextSource, generate_corpus, sample_lengths, scale_buckets


def bucket_of(n, bounds):
    for i, (lo, hi) in enumerate(bounds):
        if lo <= n < hi:
            return i
    raise AssertionError(f"length {n} is in no bucket")


@pytest.mark.parametrize("max_len", [4096, 2048, 512])
def test_proportions_and_bounds(max_len):
    n = 20_000
    lengths = sample_lengths(n, random.Random(1), max_len)
    bounds = [(b.lo, b.hi) for b in scale_buckets(max_len)]
    counts = Counter(bucket_of(x, bounds) for x in lengths)
    for i, expected in enumerate((0.70, 0.25, 0.05)):
        assert counts[i] / n == pytest.approx(expected, abs=0.015)
    assert 1 <= min(lengths) and max(lengths) <= max_len


def test_reference_bounds_and_scaling():
    assert [(b.lo, b.hi) for b in scale_buckets(4096)] == [(32, 512), (512, 2048), (2048, 4096)]
    assert [(b.lo, b.hi) for b in scale_buckets(2048)] == [(16, 256), (256, 1024), (1024, 2048)]
    assert all(b.lo >= 1 and b.hi > b.lo for b in scale_buckets(8))


def test_mean_within_a_uniform_bucket():
    lengths = sample_lengths(20_000, random.Random(2))
    short = [x for x in lengths if x < 512]
    assert sum(short) / len(short) == pytest.approx(271.5, rel=0.02)


def test_seeded():
    assert sample_lengths(50, random.Random(3)) == sample_lengths(50, random.Random(3))
    assert generate_corpus(100, seed=4) == generate_corpus(100, seed=4)
    assert generate_corpus(100, seed=4) != generate_corpus(100, seed=5)


def test_text_source_wraps():
    src = TextSource(["a", "b", "c"])
    assert src.text(2, 4) == "c a b c"
    assert len(TextSource.builtin(num_words=1000).text(990, 25).split()) == 25
