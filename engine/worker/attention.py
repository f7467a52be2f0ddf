"""The paged attention layer. Each step's `AttentionMetadata` carries the attention backend that
built it (engine/worker/attention_backend.py); the layer shapes q/k/v into heads and hands them to it,
so the model knows nothing of how (or where) attention runs."""

from __future__ import annotations

from torch import nn

from engine.worker.attention_backend import AttentionMetadata, PrefillSpan

__all__ = ["AttentionMetadata", "PagedAttention", "PrefillSpan"]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale

    def forward(self, q, k, v, meta: AttentionMetadata, kv_cache):
        """q: [T, heads * d], k/v: [T, kv_heads * d]; returns [T, heads * d]."""
        T = q.shape[0]
        out = meta.backend.forward(self, q.view(T, self.num_heads, self.head_size),
                                   k.view(T, self.num_kv_heads, self.head_size),
                                   v.view(T, self.num_kv_heads, self.head_size), meta, kv_cache)
        return out.view(T, self.num_heads * self.head_size)
