"""The paged attention layer. Each step's `AttentionMetadata` carries the attention backend that
built it (engine/worker/attention_backend.py); the layer shapes q/k/v into heads and hands them to it,
so the model knows nothing of how (or where) attention runs."""

from __future__ import annotations

from torch import nn

from engine.worker.attention_backend import AttentionMetadata, PrefillSpan

__all__ = ["AttentionMetadata", "PagedAttention", "PrefillSpan"]


class PagedAttention(nn.Module):
    """Causal attention over the paged cache, GQA (query head h reads KV head h // (heads / kv_heads)).

    `sliding_window` W: a query at position p attends to positions p - W + 1 .. p only (the last
    W positions, itself included: HF's masking_utils.sliding_window_overlay, kv > q - W); None:
    to every earlier position. `logit_softcap` c: scores (q.k * scale) become c * tanh(scores / c)
    before the mask and the softmax (Gemma 2's attn_logit_softcapping); None: left as they are."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window {sliding_window} must be at least 1")
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # the KV layer group whose block tables it reads (engine/core/kv_layout.py; set by the
        # model runner with the pool's layout): `meta.groups[kv_group]`
        self.kv_group = 0

    def forward(self, q, k, v, meta: AttentionMetadata, kv_cache):
        """q: [T, heads * d], k/v: [T, kv_heads * d]; returns [T, heads * d]."""
        T = q.shape[0]
        if self.kv_group:
            meta = meta.groups[self.kv_group]
        out = meta.backend.forward(self, q.view(T, self.num_heads, self.head_size),
                                   k.view(T, self.num_kv_heads, self.head_size),
                                   v.view(T, self.num_kv_heads, self.head_size), meta, kv_cache)
        return out.view(T, self.num_heads * self.head_size)
