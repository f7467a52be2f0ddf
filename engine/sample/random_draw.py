"""Random sampling: temperature, top-k, top-p, min-p, then one draw per row (engine/sample/sampler.py
runs the logits processors first and scores what was drawn). Every transform works on a whole
group of rows at once; Python loops run over rows, never over the vocabulary."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from cuda_ext import ops
from engine.core.sampling_params import SamplingParams

NEG_INF = float("-inf")
F32 = torch.finfo(torch.float32)
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
Generator = random.Random | torch.Generator


def index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """`ids` as an int64 index tensor on `device`."""
    return torch.tensor(ids, dtype=torch.long, device=device)


def argmax_rows(t: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (a NaN counts as the maximum), as torch.argmax."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] > 0:
        # NOTE: numpy's argmax has the same semantics and is 3-10x faster than torch's on CPU
        # (measured with torch 2.13 at [256, 1024] and [256, 49152], one thread).
        return torch.from_numpy(t.numpy().argmax(axis=-1).astype("int64", copy=False))
    return t.argmax(dim=-1)


def greedy_ids(adjusted: torch.Tensor, fallback) -> torch.Tensor:
    """The argmax of each row; `fallback(dead)` for rows whose every logit is -inf."""
    # NOTE: the first maximum, exactly as HF greedy decoding picks it.
    ids = argmax_rows(adjusted)
    dead = adjusted.gather(1, ids[:, None])[:, 0] == NEG_INF
    if bool(dead.any()):
        ids[dead] = fallback(dead.nonzero()[:, 0])
    return ids


def guard_(t: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> -inf, +inf -> the largest finite float32; -inf stays."""
    return t.nan_to_num_(nan=NEG_INF, posinf=F32.max, neginf=NEG_INF)


# The exact top-p cut-off (`sampling_probs`, and the draw's fallback) first looks for the
# nucleus among this many best tokens and sorts the whole row only when their mass falls short
# of top_p: a full sort of a 49k vocabulary is ~20x slower.
_TOP_P_CANDIDATES = 256


@dataclass
class _Nucleus:
    """Top-p left to the draw (`_draw`): the rows it applies to, their logits as top-p sees them
    (after temperature and top-k), their top_p, and how to get their exact probabilities."""

    rows: torch.Tensor  # positions among the drawn rows
    logits: torch.Tensor  # [len(rows), vocab]
    top_p: torch.Tensor  # [len(rows)] float32
    probs_ref: torch.Tensor | None  # softmax(logits) when it differs from the drawn probs (min-p), else None
    exact: object  # exact(positions) -> those rows' probabilities with the top-p mask applied


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams], fallback=None,
                    lazy_top_p: bool = False):
    """Probabilities to draw from, for rows that do not decode greedily. Never edits `logits`.

    Every row is finite, non-negative and sums to 1. A row left with no finite logit puts all
    its mass on its best logit, or when every token is masked, on `fallback(rows)` (token ids
    for those row positions; token 0 without a fallback).

    With `lazy_top_p`, returns (probs without the top-p mask, a `_Nucleus` or None): `_draw`
    then applies top-p by rejection, which needs no sort of the vocabulary (see `_draw`).
    """
    if lazy_top_p:
        return _probs(logits, params, fallback, lazy=True)
    return _probs(logits, params, fallback, lazy=False)[0]


def _probs(logits: torch.Tensor, params: list[SamplingParams], fallback, lazy: bool):
    dev, vocab = logits.device, logits.shape[1]
    temps = _temperatures(params, dev)
    original, logits = logits, guard_(logits / temps[:, None])  # a fresh tensor: everything below edits it in place

    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    sel = [i for i, k in enumerate(top_k) if k < vocab]
    if sel:
        ks = torch.tensor([top_k[i] for i in sel], dtype=torch.long, device=dev)
        sub = select_rows(logits, sel)
        kth = torch.topk(sub, int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        # NOTE: tokens tied with the k-th value survive, as in HF and vLLM.
        _set_rows(logits, sel, sub.masked_fill_(sub < kth, NEG_INF))

    nucleus = None
    sel = top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    min_p_in_nucleus = any(params[i].min_p > 0.0 for i in top_p_rows)
    if sel:
        top_p = torch.tensor([params[i].top_p for i in sel], dtype=torch.float32, device=dev)
        sub = select_rows(logits, sel)
        if lazy:
            # NOTE: a copy when min-p edits `logits` below; the exact path is kept for rows
            # that the rejection does not settle quickly.
            ref = sub.clone() if sub is logits and min_p_in_nucleus else sub
            nucleus = _Nucleus(index_tensor(sel, dev), ref, top_p, None, None)
        else:
            cut = _top_p_cutoff(sub, top_p)
            _set_rows(logits, sel, sub.masked_fill_(sub < cut, NEG_INF))

    sel = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if sel:
        min_p = torch.tensor([params[i].min_p for i in sel], dtype=torch.float32, device=dev)
        sub = select_rows(logits, sel)
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); the best token always stays.
        best = sub.max(dim=-1, keepdim=True).values
        cut = torch.minimum(best + torch.log(min_p)[:, None], best)
        _set_rows(logits, sel, sub.masked_fill_(sub < cut, NEG_INF))

    probs = _with_fallback(logits.softmax(dim=-1), original, fallback or torch.zeros_like)
    if nucleus is not None:
        if min_p_in_nucleus:
            nucleus.probs_ref = nucleus.logits.softmax(dim=-1)

        def exact(positions: torch.Tensor) -> torch.Tensor:
            rows = [top_p_rows[i] for i in positions.tolist()]
            return sampling_probs(original.index_select(0, index_tensor(rows, dev)), [params[i] for i in rows], fallback)

        nucleus.exact = exact
    return probs, nucleus


def draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[Generator | None],
         fallback) -> torch.Tensor:
    """One token per row of `logits` (rows that do not decode greedily; never edited), drawn
    from `params`' distribution with one number per row from `generators` (see `_uniforms`),
    plus one more per rejected top-p round; `fallback(positions)` gives the tokens of rows
    left with no finite logit.

    Rows with only temperature and top-p (no top-k, no min-p) on CPU logits go through the
    compiled `draw_tokens` first: softmax, the draw and top-p's acceptance test in a few passes
    per row instead of ~15 torch ops over the whole batch (measured on one thread: 8.7 -> 1.7 ms
    at [256, 1024], 75 -> 10 ms at [64, 49152]); then again for the rows whose draw top-p
    rejected, each with its next number, as `_draw`'s rounds do. The rows still undecided after
    those rounds (or with no finite logit) take the general path, which goes on drawing their
    next numbers.
    """
    plain = _plain_rows(logits, params)
    if len(plain) == len(params):
        return _fused_draw(logits, params, generators, fallback)
    if not plain:
        return _general_draw(logits, params, generators, fallback)
    # NOTE: a batch mixing both splits, so that one top-k request does not slow every row.
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    plain_set = set(plain)
    for rows, run in ((plain, _fused_draw), ([i for i in range(len(params)) if i not in plain_set], _general_draw)):
        index = index_tensor(rows, logits.device)
        tokens[index] = run(logits.index_select(0, index), [params[i] for i in rows], [generators[i] for i in rows],
                            lambda dead, index=index: fallback(index[dead]))
    return tokens


def _plain_rows(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """The rows `_fused_draw` can take: temperature and top-p only, float32 CPU logits."""
    vocab = logits.shape[1]
    if logits.dtype != torch.float32 or vocab == 0 or not ops.draw_tokens_compiled(logits):
        return []
    return [i for i, p in enumerate(params) if (p.top_k <= 0 or p.top_k >= vocab) and p.min_p <= 0.0]


def _fused_draw(logits, params, generators, fallback) -> torch.Tensor:
    temps = _temperatures(params, logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    tokens = ops.draw_tokens(logits, temps, top_p, _uniforms(generators))
    left = (tokens < 0).nonzero()[:, 0]
    for _ in range(_TOP_P_ROUNDS - 1):  # a rejected row draws again with its next number
        if not left.numel():
            return tokens
        again = ops.draw_tokens(logits.index_select(0, left), temps[left], top_p[left],
                                _uniforms([generators[i] for i in left.tolist()]))
        tokens[left] = again
        left = left[again < 0]
    if left.numel():
        pos = left.tolist()
        tokens[left] = _general_draw(logits.index_select(0, left), [params[i] for i in pos],
                                     [generators[i] for i in pos], lambda dead: fallback(left[dead]))
    return tokens


def _general_draw(logits, params, generators, fallback) -> torch.Tensor:
    probs, nucleus = sampling_probs(logits, params, fallback, lazy_top_p=True)
    return _draw(probs, generators, nucleus)


def _temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """Each row's temperature as float32. NOTE: 1e308 is inf in float32, and -inf / inf is NaN:
    clamped to the largest float32, a huge temperature flattens the finite logits to (nearly) 0,
    a uniform draw over them."""
    return torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device).clamp_(max=F32.max)


def _with_fallback(probs: torch.Tensor, logits: torch.Tensor, fallback) -> torch.Tensor:
    """Rows that softmax turned into NaN (no finite logit left; nothing else is NaN after the
    guard) become one-hot: on the argmax of the row's `logits` (before temperature) if that is
    finite, else on `fallback(rows)`."""
    dead = probs[:, 0].isnan()
    if bool(dead.any()):
        rows = dead.nonzero()[:, 0]
        tokens = greedy_ids(logits.index_select(0, rows), lambda gone: fallback(rows[gone]))
        probs[rows] = 0.0
        probs[rows, tokens.to(probs.device)] = 1.0
    return probs


def select_rows(t: torch.Tensor, sel: list[int]) -> torch.Tensor:
    """The selected rows as a tensor that may be edited in place (a view when it is all rows)."""
    return t if len(sel) == t.shape[0] else t[index_tensor(sel, t.device)]


def _set_rows(t: torch.Tensor, sel: list[int], values: torch.Tensor) -> None:
    if values is not t:
        t[index_tensor(sel, t.device)] = values


def _top_p_cutoff(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1] logit cutoffs: the nucleus is the smallest set of best tokens whose mass
    reaches top_p; tokens below the cutoff are dropped, ties with the last kept token stay."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    k = min(_TOP_P_CANDIDATES, logits.shape[1])
    values = torch.topk(logits, k, dim=-1).values
    cut, covered = _cutoff_in(values, (values - lse).exp(), top_p)
    if not bool(covered.all()):
        missing = (~covered).nonzero()[:, 0]
        values = logits[missing].sort(dim=-1, descending=True).values
        cut[missing] = _cutoff_in(values, (values - lse[missing]).exp(), top_p[missing])[0]
    return cut


def _cutoff_in(sorted_logits, sorted_probs, top_p):
    cumulative = sorted_probs.cumsum(dim=-1)
    # A token stays while the mass of the better tokens is still short of top_p; the best
    # token always stays.
    # NOTE: clamped, because top_p = 1e-300 is 0 in float32 (and a row of -inf gives NaN
    # probabilities): keep = 0 would gather index -1, a device-side assert on a GPU.
    keep = ((cumulative - sorted_probs) < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    covered = cumulative[:, -1] >= top_p
    return sorted_logits.gather(1, keep - 1), covered


# Rejection rounds for top-p before the rows left fall back to the exact (sorting) cut-off.
_TOP_P_ROUNDS = 3


def _draw(probs: torch.Tensor, generators: list[Generator | None], nucleus: _Nucleus | None = None
          ) -> torch.Tensor:
    """One token per row by inverting the CDF at one uniform number per row.

    A seeded row takes its numbers from its own generator, so its tokens depend only on its own
    probabilities and seed, never on the rest of the batch. A token of probability 0 adds
    nothing to the CDF, so the search can never land on it. (u has 24 random bits: a token's
    chance is resolved to about 6e-8.)

    Top-p (`nucleus`) by rejection: a token x drawn from the distribution without the top-p mask
    is in the nucleus exactly when the tokens strictly more likely than x (top-p's view: after
    temperature and top-k) hold less than top_p of the mass; an accepted draw is a draw from
    the nucleus, renormalised. A rejected row draws again with its next number; after a few
    rounds (the nucleus holds at least top_p of the mass, so rarely) the rows left use the
    exact, sorting cut-off. One pass over the vocabulary per round instead of a sort.
    """
    tokens = _invert(probs, _uniforms(generators))
    if nucleus is None:
        return tokens
    pending = torch.arange(len(nucleus.rows), device=probs.device)  # positions in nucleus
    everyone = len(nucleus.rows) == probs.shape[0]  # then rows == pending at the first round
    for _ in range(_TOP_P_ROUNDS):
        if everyone:  # NOTE: the common first round: every row, no gathers of whole rows
            rows, ref, everyone = pending, nucleus.logits, False
            mass = probs if nucleus.probs_ref is None else nucleus.probs_ref
        else:
            rows = nucleus.rows.index_select(0, pending)
            ref = nucleus.logits.index_select(0, pending)
            mass = (probs if nucleus.probs_ref is None else nucleus.probs_ref)
            mass = mass.index_select(0, rows if nucleus.probs_ref is None else pending)
        chosen = ref.gather(1, tokens.index_select(0, rows)[:, None])
        above = _mass_above(ref, chosen, mass)
        rejected = ~(above < nucleus.top_p.index_select(0, pending))
        pending = pending[rejected]
        if pending.numel() == 0:
            return tokens
        rows = rows[rejected]
        gens = [generators[i] for i in rows.tolist()]
        tokens[rows] = _invert(probs.index_select(0, rows), _uniforms(gens))
    rows = nucleus.rows.index_select(0, pending)
    exact = nucleus.exact(pending)
    tokens[rows] = _invert(exact, _uniforms([generators[i] for i in rows.tolist()]))
    return tokens


def _mass_above(ref: torch.Tensor, chosen: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of `mass` over the tokens whose `ref` logit is above `chosen` [rows, 1]."""
    # NOTE: sign(ref - chosen) clamped at 0 is the indicator of ref > chosen, and ~2x faster on
    # CPU than a bool comparison times the mass. A NaN (-inf - -inf: a row with nothing left,
    # whose chosen token is its fallback) is no token above it, as the comparison says.
    above = torch.sign(ref - chosen).clamp_(min=0.0).nan_to_num_(nan=0.0)
    return above.mul_(mass).sum(dim=-1)


def _uniforms(generators: list[Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from the row's generator, else the global RNG.

    A seeded row's generator is a `random.Random` (the engine's: a float64 number costs well
    under a microsecond) or a `torch.Generator` (drawn on its own device, so a CPU generator also
    serves CUDA logits; ~10 us each)."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):  # the common case: no list-indexed write
        return torch.rand(len(generators))
    u = torch.empty(len(generators), dtype=torch.float32)
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded))
    if len(unseeded) < len(generators):
        values = u.tolist()
        for i, g in enumerate(generators):
            if isinstance(g, random.Random):
                # NOTE: rounded down to a float32 below 1, as torch.rand's numbers are.
                values[i] = min(g.random(), _BELOW_ONE)
            elif g is not None:
                values[i] = torch.rand(1, generator=g, device=g.device).item()
        u = torch.tensor(values, dtype=torch.float32)
    return u


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at which each row's CDF passes u times the row's total mass.

    In two levels, which reads each row once instead of one long cumulative sum (~3x slower on
    CPU): the CDF over blocks of `width` tokens picks the block, then the CDF inside that block
    picks the token. The position inside the block is relative to the block's start and kept
    strictly below the block's own total, so the search lands on a token whose probability is
    positive whatever the rounding of the two sums."""
    rows, vocab = probs.shape
    width = _block_width(vocab)
    pad = -vocab % width
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, width)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [rows, blocks]
    total = block_cdf[:, -1:]
    # NOTE: u < 1, but u * total may round up to total; stay strictly below it.
    target = torch.minimum(u.to(probs.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, width))[:, 0].cumsum(dim=-1)  # [rows, width]
    end = inner[:, -1:]
    offset = torch.minimum((target - before).clamp_(min=0.0), torch.nextafter(end, torch.zeros_like(end)))
    token = torch.searchsorted(inner, offset, right=True).clamp_(max=width - 1)
    return (block * width + token)[:, 0].clamp_(max=vocab - 1)


def _block_width(vocab: int) -> int:
    """A power of two near sqrt(vocab), at least 16: both levels of `_invert` stay short."""
    width = 16
    while width * width < vocab:
        width *= 2
    return width
