"""Exact attention with a sliding window and/or logit soft-capping, in torch: what
`TorchPagedBackend` runs for a layer whose window or soft-cap its compiled kernels do not
compute (engine/worker/attention_backend.py). Works on any device and dtype."""

from __future__ import annotations

import torch

# NOTE: queries go in chunks of this many rows, so that a long prompt's scores take
# heads x 128 x (its keys) floats at a time, never heads x L x S.
QUERY_CHUNK = 128


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, scale: float,
           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [L, heads, d] (positions q_start .. q_start + L - 1) over k/v
    [S, kv_heads, d] (positions k_start .. k_start + S - 1, which must hold every position a
    query attends to); returns [L, heads, d] in q's dtype.

    As HF's eager attention: scores = (q . k) * scale; with `softcap` c, c * tanh(scores / c);
    then a query at p sees keys at kp <= p and, with `window` W, kp > p - W; softmax in fp32,
    its weights in q's dtype times v. GQA: query head h reads KV head h // (heads / kv_heads)."""
    L, H, d = q.shape
    S, kv_heads = k.shape[0], k.shape[1]
    group = H // kv_heads
    out = torch.empty(L, H, d, dtype=q.dtype, device=q.device)
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, S, d]
    for a in range(0, L, QUERY_CHUNK):
        b = min(L, a + QUERY_CHUNK)
        first, last = q_start + a, q_start + b - 1  # the chunk's query positions
        lo = k_start if window is None else max(k_start, first - window + 1)
        hi = min(k_start + S, last + 1)  # keys [lo, hi) are all this chunk can see
        ks, vs = keys[:, lo - k_start:hi - k_start], values[:, lo - k_start:hi - k_start]
        qg = q[a:b].reshape(b - a, kv_heads, group, d).permute(1, 2, 0, 3)  # [kv_heads, group, rows, d]
        scores = torch.matmul(qg, ks.unsqueeze(1).transpose(-1, -2)) * scale  # [kv_heads, group, rows, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(first, last + 1, device=q.device).unsqueeze(1)
        kpos = torch.arange(lo, hi, device=q.device).unsqueeze(0)
        seen = kpos <= qpos
        if window is not None:
            seen &= kpos > qpos - window
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(weights, vs.unsqueeze(1))  # [kv_heads, group, rows, d]
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, H, d)
    return out


def first_block(context_start: int, window: int | None, block_size: int) -> int:
    """The first block of a sequence's table holding a position that a query at `context_start`
    or later can see (0 without a window): blocks before it need not be read."""
    if window is None:
        return 0
    return max(0, context_start - window + 1) // block_size
