"""Benchmark workloads: the skewed sequence-length distribution and a built-in prompt corpus.

The length distribution is the one from the PagedAttention seed article and issue 8: 70% of
sequences uniform in [32, 512), 25% in [512, 2048), 5% in [2048, 4096), for a context of 4,096.
For other contexts every bound is scaled by `max_len / 4096`, so the shape stays the same.
Both `kv_waste.py` (the simulation) and `serve.py` (prompt lengths) draw from `sample_lengths`.

Everything here takes a `random.Random`, so a seed fixes the whole workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

REFERENCE_MAX_LEN = 4096  # the context the bucket bounds below are written for

# A few short instructions for the server-level benchmarks (soak, health latency).
SHORT_PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List some facts about the moon.",
    "Describe the water cycle for a child.",
)


@dataclass(frozen=True)
class LengthBucket:
    """A share of the sequences, with lengths uniform in [lo, hi) (at the reference context)."""

    weight: float
    lo: int
    hi: int


# The seed article's distribution: mostly short requests, a few very long ones.
SKEWED_BUCKETS: tuple[LengthBucket, ...] = (
    LengthBucket(0.70, 32, 512),
    LengthBucket(0.25, 512, 2048),
    LengthBucket(0.05, 2048, 4096),
)


def scale_buckets(max_len: int, buckets: tuple[LengthBucket, ...] = SKEWED_BUCKETS
                  ) -> tuple[LengthBucket, ...]:
    """Return `buckets` with bounds scaled from REFERENCE_MAX_LEN to `max_len`.

    Bounds are rounded down; every range keeps at least one value (lo >= 1, hi > lo), so a
    very small context still gives valid, if coarse, lengths.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    scaled = []
    for b in buckets:
        lo = max(1, b.lo * max_len // REFERENCE_MAX_LEN)
        hi = max(lo + 1, b.hi * max_len // REFERENCE_MAX_LEN)
        scaled.append(LengthBucket(b.weight, lo, min(hi, max_len + 1)))
    return tuple(scaled)


def sample_length(rng: random.Random, buckets: tuple[LengthBucket, ...] = SKEWED_BUCKETS) -> int:
    """Draw one length: pick a bucket by weight, then a length uniform in [lo, hi).

    Two draws per length, as in the seed article's program (one for the bucket, one inside it).
    """
    r = rng.random()
    cumulative = 0.0
    for b in buckets:
        cumulative += b.weight
        if r < cumulative:
            return rng.randrange(b.lo, b.hi)
    last = buckets[-1]  # NOTE: weights summing to 0.999... must not fall off the end
    return rng.randrange(last.lo, last.hi)


def sample_lengths(n: int, rng: random.Random, max_len: int = REFERENCE_MAX_LEN,
                   buckets: tuple[LengthBucket, ...] = SKEWED_BUCKETS) -> list[int]:
    """Draw `n` lengths from `buckets` scaled to `max_len`; every length is in [1, max_len]."""
    scaled = scale_buckets(max_len, buckets) if max_len != REFERENCE_MAX_LEN else buckets
    return [sample_length(rng, scaled) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Prompt text
# ---------------------------------------------------------------------------------------------

_NOUNS = (
    "engine scheduler block table request token sequence cache memory server client kernel "
    "batch queue model layer weight tensor window river mountain city garden library market "
    "harbor forest village teacher student doctor farmer painter writer sailor engineer "
    "morning evening winter summer letter story question answer bridge road tower field "
    "machine signal report paper network system process thread page record"
).split()
_VERBS = (
    "reads writes holds moves builds finds keeps opens closes carries sends answers follows "
    "measures counts shares copies frees allocates schedules serves waits grows walks watches "
    "explains remembers changes checks starts stops leaves crosses turns"
).split()
_ADJECTIVES = (
    "small large quiet busy early late bright dark careful quick slow old new long short warm "
    "cold simple strange patient tired curious shared free empty full distant nearby"
).split()
_LINKS = "and but while because so then after before although when".split()
_DETERMINERS = "the a every each one another this that".split()


def generate_corpus(num_words: int, seed: int = 0) -> list[str]:
    """Return `num_words` words of plain, grammatical-looking English sentences.

    Built in so a benchmark needs no download; seeded so two runs send the same prompts.
    The text is varied enough that a tokenizer sees ordinary words and punctuation.
    """
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < num_words:
        clause = [rng.choice(_DETERMINERS), rng.choice(_ADJECTIVES), rng.choice(_NOUNS),
                  rng.choice(_VERBS), rng.choice(_DETERMINERS), rng.choice(_NOUNS)]
        if rng.random() < 0.5:
            clause += [rng.choice(_LINKS), rng.choice(_DETERMINERS), rng.choice(_NOUNS),
                       rng.choice(_VERBS)]
        clause[0] = clause[0].capitalize()
        clause[-1] += "."
        words.extend(clause)
    return words[:num_words]


class TextSource:
    """A pool of words that prompts are cut from: the built-in corpus or a text file."""

    def __init__(self, words: list[str]):
        if not words:
            raise ValueError("the text source has no words")
        self.words = words

    @classmethod
    def builtin(cls, seed: int = 0, num_words: int = 200_000) -> "TextSource":
        return cls(generate_corpus(num_words, seed))

    @classmethod
    def from_file(cls, path: str | Path) -> "TextSource":
        return cls(Path(path).read_text(encoding="utf-8", errors="replace").split())

    def text(self, offset: int, num_words: int) -> str:
        """`num_words` words starting at `offset`, wrapping around the end of the pool."""
        n = len(self.words)
        return " ".join(self.words[(offset + i) % n] for i in range(max(1, num_words)))
