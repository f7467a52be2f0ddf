"""Pure-torch reference of every op in :mod:`cuda_ext.ops`.

Slow but obviously correct: the tests compare the compiled kernels against these, and
:mod:`cuda_ext.ops` falls back to them (with a warning) when the extension cannot be built.
Cache layout everywhere: ``[num_blocks, num_kv_heads, block_size, head_size]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write token ``i``'s K/V (``[num_tokens, num_kv_heads, head_size]``) into slot
    ``slot_mapping[i]`` of the caches (in place). A negative slot means skip the token."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # NOTE: advanced indices around a slice move the indexed dims first: the target view is
    # [num_kept_tokens, num_kv_heads, head_size], the same shape as key[keep].
    key_cache[blocks, :, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[keep].to(value_cache.dtype)


def gather_cached_kv(
    key_cache: Tensor, value_cache: Tensor, block_table: Tensor | Sequence[int], context_len: int
) -> tuple[Tensor, Tensor]:
    """K and V of one sequence, ``[context_len, num_kv_heads, head_size]`` each, read through
    its block table (1-D tensor or list of block ids; entries past the context are ignored)."""
    block_size = key_cache.shape[2]
    num_blocks = -(-int(context_len) // block_size)
    table = torch.as_tensor(block_table, dtype=torch.long, device=key_cache.device)[:num_blocks]

    def gather(cache: Tensor) -> Tensor:
        # [n, kv_heads, block_size, head] -> [n * block_size, kv_heads, head]
        blocks = cache[table].transpose(1, 2)
        return blocks.reshape(-1, cache.shape[1], cache.shape[3])[:context_len]

    return gather(key_cache), gather(value_cache)


def paged_attention(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int,
) -> None:
    """Decode attention, one query token per sequence, written into ``out`` (in place).

    ``query``/``out``: ``[num_seqs, num_heads, head_size]``; ``block_tables``:
    ``[num_seqs, max_blocks_per_seq]``; ``context_lens``: ``[num_seqs]``. Query head ``h`` reads
    KV head ``h // (num_heads // num_kv_heads)``. Softmax in fp32. A sequence with context
    length 0 gets zeros. ``max_context_len`` is unused here (kept for the common signature).
    """
    del max_context_len
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    lens = context_lens.tolist()
    for i, context_len in enumerate(lens):
        if context_len == 0:
            out[i].zero_()
            continue
        k, v = gather_cached_kv(key_cache, value_cache, block_tables[i], context_len)
        q = query[i].float().view(num_kv_heads, group, head_size)
        scores = torch.einsum("kgd,tkd->kgt", q, k.float()) * scale
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgt,tkd->kgd", probs, v.float())
        out[i].copy_(o.reshape(num_heads, head_size))


def copy_blocks(
    key_caches: Sequence[Tensor], value_caches: Sequence[Tensor], block_mapping: Tensor
) -> None:
    """For every layer's caches, copy block ``src`` to block ``dst`` for each ``(src, dst)`` row
    of ``block_mapping`` (``[num_pairs, 2]``), in place."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=key_caches[0].device, dtype=torch.long)
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy block ``s`` of ``src`` into block ``d`` of ``dst`` for each ``(s, d)`` row of
    ``block_mapping`` (a CPU tensor); ``src`` and ``dst`` may live on different devices."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s], non_blocking=True)


def draw_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor, tokens: Tensor) -> None:
    """The sampler's fused draw, written into ``tokens`` (int64 ``[rows]``): per row,
    ``softmax(logits / temperature)`` (NaN -> -inf, +inf -> the largest float32), the first
    token whose cumulative mass passes ``u`` times the total (in float64, never a token of
    mass 0), then top-p's test: -1 (undecided) unless ``top_p >= 1`` or the tokens strictly
    more likely than the drawn one hold less than ``top_p`` of the mass; -1 also for a row with
    no finite logit."""
    f32 = torch.finfo(torch.float32)
    x = (logits.float() / temperature[:, None]).nan_to_num(nan=float("-inf"), posinf=f32.max, neginf=float("-inf"))
    best = x.max(dim=-1, keepdim=True).values
    alive = best[:, 0] > float("-inf")
    e = torch.where(x == float("-inf"), 0.0, (x - best.clamp(min=-f32.max)).exp()).double()
    total = e.sum(dim=-1)
    cdf = e.cumsum(dim=-1)
    target = u.double() * total
    tok = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=logits.shape[1] - 1)
    chosen = x.gather(1, tok[:, None])
    above = (e * (x > chosen)).sum(dim=-1)
    accepted = (top_p >= 1.0) | (above < top_p.double() * total)
    tokens.copy_(torch.where(alive & accepted, tok, -1))


def score_tokens(logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The compiled ``score_tokens`` in torch: (the targets' logprobs, their ranks as int32, the
    ``k`` best ids and their logprobs) per row. A NaN logprob (a row of -inf, or NaN logits) is
    reported as -inf."""
    logits = logits.float()
    targets = targets.to(device=logits.device, dtype=torch.long)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, targets[:, None])
    ranks = (logits > chosen).sum(dim=-1, dtype=torch.int32) + 1
    logprobs = (chosen - lse)[:, 0]
    values, ids = torch.topk(logits, k, dim=-1) if k > 0 else (logits[:, :0], logits[:, :0].long())
    values = values - lse
    neg_inf = float("-inf")
    return logprobs.masked_fill_(logprobs.isnan(), neg_inf), ranks, ids, values.masked_fill_(values.isnan(), neg_inf)


# The model's elementwise work (the compiled versions fuse each into one pass: cpu/fused.cpp).
# These are what engine/models/layers.py always ran; the compiled ones match them to rounding.


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weight * RMS-normalised (x + residual), x + residual); statistics in float32."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate ``query`` [T, heads, d] and ``key`` [T, kv_heads, d] in place by the rows
    ``positions`` of ``cos`` / ``sin`` [max_positions, d] (NeoX / HF rotate-half layout)."""
    c = cos[positions].unsqueeze(1).to(query.dtype)
    s = sin[positions].unsqueeze(1).to(query.dtype)
    query.copy_(query * c + rotate_half(query) * s)
    key.copy_(key * c + rotate_half(key) * s)


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
