"""The paged attention layer: writes this step's K/V into their cache slots, then attends.

Prefill sequences use SDPA (over fresh K/V, or over K/V gathered from cached blocks when part
of the prompt was already cached); decode tokens use the `paged_attention` op, which reads K/V
through each sequence's block table. All cache access goes through `cuda_ext.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import ops


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence's tokens in the flattened batch
    end: int  # one past its last row
    num_cached: int  # tokens of this sequence already in the cache before this step
    block_table: torch.Tensor  # [num_blocks] int64 physical block ids (only needed if num_cached > 0)


@dataclass
class AttentionMetadata:
    """How the flattened token batch of one step maps onto sequences and cache slots.
    Prefill tokens come first (rows [0, num_prefill_tokens)), then one row per decode sequence."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of every token (-1: do not cache)
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token
    max_decode_context_len: int


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale

    def forward(self, q, k, v, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """q: [T, heads * d], k/v: [T, kv_heads * d]; returns [T, heads * d]."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_size)
        k = k.view(T, self.num_kv_heads, self.head_size)
        v = v.view(T, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for span in meta.prefills:
            qs = q[span.start : span.end]
            if span.num_cached == 0:
                ks, vs = k[span.start : span.end], v[span.start : span.end]
            else:
                ks, vs = ops.gather_cached_kv(
                    key_cache, value_cache, span.block_table, span.num_cached + span.end - span.start
                )
            out[span.start : span.end] = self._prefill(qs, ks, vs, span.num_cached)
        P = meta.num_prefill_tokens
        if P < T:
            ops.paged_attention(
                out[P:],
                q[P:],
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                meta.max_decode_context_len,
            )
        return out.view(T, self.num_heads * self.head_size)

    def _prefill(self, q, k, v, num_cached: int) -> torch.Tensor:
        """Causal attention of q (the new tokens, positions num_cached..) over k/v (all tokens)."""
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, L, d]
        if num_cached == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            L, S = q.shape[2], k.shape[2]
            mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
