"""Qwen3 (dense): Llama's layers with an RMSNorm over each head of the queries and of the keys,
before the rotary embedding (HF's Qwen3Attention.q_norm / k_norm)."""

from __future__ import annotations

from engine.worker.attention import AttentionMetadata
from engine.worker.models.layers import RMSNorm, RotaryEmbedding, rms_norm_heads_
from engine.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    norm_cls: type[RMSNorm] = RMSNorm  # the per-head norms' class (Gemma 3's adds 1 to its weight)

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        self.q_norm = self.norm_cls(self.head_size, config.rms_norm_eps)
        self.k_norm = self.norm_cls(self.head_size, config.rms_norm_eps)

    def forward(self, positions, x, meta: AttentionMetadata, kv_cache, rows=None):
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q3, k3 = q.view(T, self.num_heads, self.head_size), k.view(T, self.num_kv_heads, self.head_size)
        rms_norm_heads_(self.q_norm, q3)
        rms_norm_heads_(self.k_norm, k3)
        self.rotary(positions, q3, k3)
        o = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model  # the compiled decoder stack runs it (its qk_norms)
