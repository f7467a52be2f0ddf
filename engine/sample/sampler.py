"""Turning one step's logits into one token per sequence.

The order follows vLLM: logit bias, the engine's forbidden tokens (min_tokens), repetition
penalty, frequency and presence penalties; then greedy argmax, or temperature, top-k, top-p,
min-p and a draw. Every transform works on a whole group of rows at once; Python loops run over
rows, never over the vocabulary.

Logprobs are always the raw model's (log_softmax of the logits as the model produced them),
whatever the sampling settings did to the distribution the token was drawn from.

Extreme settings stay well defined: logits are guarded after penalties and temperature (NaN
becomes -inf, +inf the largest finite float32, so that ties are well defined), top-k, top-p and
min-p always keep the best token (and those tied with it), and a row left with no finite logit
(every token masked) takes the raw model's argmax instead of a draw from NaN.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain

import torch

from cuda_ext import ops, reference
from engine.core.sampling_params import SamplingParams
from engine.core.step import SampleResult
from engine.sample.random_draw import F32, NEG_INF, Generator, draw, greedy_ids, guard_, index_tensor, select_rows


@dataclass(slots=True)
class SamplingRow:
    """One sequence's row of the logits and what the sampler needs to know about it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-sequence generator seeded from params.seed (a random.Random, or a torch.Generator);
    # None draws from the global RNG.
    generator: Generator | None = None
    # Token ids forbidden this step (the engine passes EOS + stop_token_ids while
    # len(output) < min_tokens). Ids outside the vocabulary are ignored.
    masked_token_ids: set[int] | frozenset[int] = frozenset()
    # Read from `params` once (a request's params do not change while it runs), since the
    # sampler sorts every row at every step: greedy or random, and scored (`needs_scores`).
    greedy: bool = field(init=False)
    scored: bool = field(init=False)
    may_edit: bool = field(init=False)  # some logits processor may change the row (`_edits`)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.is_greedy
        self.scored = needs_scores(p)
        self.may_edit = bool(p.logit_bias or self.masked_token_ids or p.repetition_penalty != 1.0
                             or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)


class Sampler:
    """Stateless: all per-request state (seeded generators, token history) comes in the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """Sample one token per row. `logits` is [len(rows), vocab] and is never modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return []
        adjusted = self._adjusted(logits, rows, copy=False)
        # NOTE: one pass over the rows sorts them (greedy or random, scored): this runs for every
        # sequence at every step.
        greedy, random, scored = [], [], []
        for i, r in enumerate(rows):
            (greedy if r.greedy else random).append(i)
            if r.scored:
                scored.append(i)

        if not random:
            token_ids = greedy_ids(adjusted, _raw_argmax(logits, greedy))
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[index_tensor(greedy, logits.device)] = greedy_ids(select_rows(adjusted, greedy),
                                                                   _raw_argmax(logits, greedy))
            params = [rows[i].params for i in random]
            sub = select_rows(adjusted, random)
            token_ids[index_tensor(random, logits.device)] = draw(sub, params, [rows[i].generator for i in random],
                                                            _raw_argmax(logits, random))
        # NOTE: scoring costs full-vocabulary passes (logsumexp, rank): only for rows that use it.
        if len(scored) == len(rows):
            return score_tokens(logits, token_ids, [r.params.logprobs for r in rows])
        results = [SampleResult(t, None, None, None) for t in token_ids.tolist()]
        if scored:
            index = index_tensor(scored, logits.device)
            for i, r in zip(scored, score_tokens(logits.index_select(0, index), token_ids.index_select(0, index),
                                                 [rows[i].params.logprobs for i in scored])):
                results[i] = r
        return results

    def adjusted_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """A float32 copy of `logits` with logit bias, masked tokens and penalties applied.

        Greedy decoding takes the argmax of this; beam search can score its log_softmax.
        """
        return self._adjusted(logits, rows, copy=True)

    @staticmethod
    def _adjusted(logits: torch.Tensor, rows: list[SamplingRow], copy: bool) -> torch.Tensor:
        # Without anything to apply, hand back the caller's tensor itself (read-only from here).
        # NOTE: `may_edit` first: most rows have no processor, and this runs for every row at every step.
        if not copy and not any(r.may_edit and _edits(r) for r in rows) and logits.dtype == torch.float32:
            return logits
        out = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        vocab = out.shape[1]
        _apply_logit_bias(out, rows, vocab)
        _apply_masks(out, rows, vocab)
        _apply_repetition_penalty(out, rows, vocab)
        _apply_frequency_presence(out, rows, vocab)
        return out


def needs_scores(params: SamplingParams) -> bool:
    """Whether a row's sampled token needs its raw logprob and rank: logprobs were asked for,
    or its samples are ranked by cumulative logprob (best_of > n)."""
    return params.logprobs is not None or params.best_of > params.n


def _raw_argmax(logits: torch.Tensor, sel: list[int]):
    """Fallback for the selected rows that have no finite logit left: given positions among
    `sel`, the raw model's argmax of those rows (computed only when such a row exists)."""

    def fallback(dead: torch.Tensor) -> torch.Tensor:
        return logits.index_select(0, index_tensor(sel, logits.device)[dead]).argmax(dim=-1)

    return fallback


def _edits(row: SamplingRow) -> bool:
    """Whether any logits processor changes this row."""
    p = row.params
    return bool(
        p.logit_bias
        or row.masked_token_ids
        or p.repetition_penalty != 1.0
        or ((p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids)
    )


def top_candidates(logprobs_row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs of a 1-D row, best first (for beam search)."""
    if k <= 0:
        return []
    k = min(k, logprobs_row.shape[-1])
    values, ids = torch.topk(logprobs_row.float(), k)
    return list(zip(ids.tolist(), values.tolist()))


# ---------------------------------------------------------------------------------------------
# Logit processors: each takes the float32 [rows, vocab] tensor and edits it in place.


def _flat_token_ids(token_lists: list[list[int]], row_ids: list[int], vocab: int, device) -> torch.Tensor:
    """Positions `row * vocab + token` in a flattened [rows, vocab] tensor, one per listed token
    (repeats kept); ids outside [0, vocab) are dropped."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    # NOTE: array('q') converts a long list of ints about twice as fast as torch.tensor(list).
    flat = array("q", chain.from_iterable(token_lists))
    if not flat:
        return torch.empty(0, dtype=torch.long, device=device)
    tokens = torch.frombuffer(flat, dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    return (rows[valid] * vocab + tokens[valid]).to(device)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
    r_idx, t_idx, vals = [], [], []
    for i, row in enumerate(rows):
        for tok, bias in row.params.logit_bias.items():
            if 0 <= tok < vocab:
                r_idx.append(i)
                t_idx.append(tok)
                vals.append(bias)
    if r_idx:
        dev = logits.device
        # NOTE: index_put_ with accumulate so a bias adds to the logit rather than replacing it.
        logits.index_put_(
            (index_tensor(r_idx, dev), index_tensor(t_idx, dev)),
            torch.tensor(vals, dtype=logits.dtype, device=dev),
            accumulate=True,
        )


def _apply_masks(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
    r_idx, t_idx = [], []
    for i, row in enumerate(rows):
        for tok in row.masked_token_ids:
            if 0 <= tok < vocab:
                r_idx.append(i)
                t_idx.append(tok)
    if r_idx:
        logits[index_tensor(r_idx, logits.device), index_tensor(t_idx, logits.device)] = NEG_INF


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
    """HF/CTRL: for every distinct token seen in prompt or output, divide a positive logit by
    the penalty and multiply a negative one by it."""
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not sel:
        return
    # NOTE: sparse over the seen (row, token) pairs, never a dense [rows, vocab] pass. A token
    # seen twice appears twice in `pos`; both writes store the same value, computed from the
    # original logit, so it is penalised once.
    flat = logits.view(-1)
    pos = _flat_token_ids([rows[i].prompt_token_ids + rows[i].output_token_ids for i in sel], sel, vocab, logits.device)
    # NOTE: a penalty of 1e-300 is 0 in float32 and 1e308 is inf; 0 * inf would be NaN. Clamped
    # into the finite positive float32 range (ordinary penalties are unchanged), only an overflow
    # to +inf remains, which the guard turns into the largest float32.
    penalty = _per_row(rows, lambda p: p.repetition_penalty, logits).clamp_(F32.tiny, F32.max)[pos // vocab]
    seen = flat[pos]
    flat[pos] = guard_(torch.where(seen > 0, seen / penalty, seen * penalty))


def _apply_frequency_presence(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
    """OpenAI: logit -= frequency_penalty * count + presence_penalty * (count > 0), counting
    only generated tokens. (Penalties are in [-2, 2]: no finite logit can overflow.)"""
    sel = [
        i
        for i, r in enumerate(rows)
        if (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0) and r.output_token_ids
    ]
    if not sel:
        return
    flat = logits.view(-1)
    pos = _flat_token_ids([rows[i].output_token_ids for i in sel], sel, vocab, logits.device)
    row = pos // vocab
    # Presence: a plain write, so repeats of a token store the same value (subtracted once);
    # frequency: an accumulating add, once per occurrence.
    flat[pos] = flat[pos] - _per_row(rows, lambda p: p.presence_penalty, logits)[row]
    flat.index_add_(0, pos, -_per_row(rows, lambda p: p.frequency_penalty, logits)[row])


def _per_row(rows: list[SamplingRow], field, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([field(r.params) for r in rows], dtype=like.dtype, device=like.device)


# ---------------------------------------------------------------------------------------------
# Logprobs of given tokens under the raw distribution.


def score_tokens(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], num_top: list[int | None] | int | None = None
) -> list[SampleResult]:
    """Raw logprob, rank and top alternatives of given tokens, one per row of `logits`.

    The sampler uses it for what it drew; the engine can use it for prompt logprobs (row i of
    the prompt's logits scores prompt token i + 1). `num_top` is per row or one for all: None
    gives top_logprobs=None, 0 an empty list.
    """
    rows = logits.shape[0]
    if not isinstance(num_top, list):
        num_top = [num_top] * rows
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    k = min(max((n or 0) for n in num_top), logits.shape[1]) if rows else 0
    # NOTE: one compiled pass pair per row on CPU logits (cpu/scoring.cpp); rows it leaves to
    # torch (NaN or +inf logits: rank 0) are scored again the torch way.
    chosen_logprobs, ranks, top_ids, top_vals = ops.score_tokens(logits, token_ids, k)
    redo = (ranks == 0).nonzero()[:, 0] if rows else ranks
    if len(redo):
        lp, rk, ti, tv = reference.score_tokens(logits.index_select(0, redo), token_ids[redo], k)
        chosen_logprobs[redo], ranks[redo], top_ids[redo], top_vals[redo] = lp, rk, ti, tv
    chosen_logprobs, ranks = chosen_logprobs.tolist(), ranks.tolist()
    if k > 0:
        top_ids, top_vals = top_ids.tolist(), top_vals.tolist()

    results = []
    for i, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), chosen_logprobs, ranks)):
        n = num_top[i]
        top = None
        if n is not None:
            top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n > 0 else []
        results.append(SampleResult(token_id=tok, logprob=lp, rank=rank, top_logprobs=top))
    return results
