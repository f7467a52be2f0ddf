"""OLMo 2 (HF's Olmo2ForCausalLM): Llama's projections with

- an RMSNorm over the whole query projection and one over the whole key projection (all heads
  at once, before splitting into heads and before the rotary embedding), HF's q_norm / k_norm;
- the block norms after the sublayers instead of before them, and no input norm:
  h = x + post_attention_layernorm(attn(x)); out = h + post_feedforward_layernorm(mlp(h)).

Under tensor parallelism each rank holds its heads' slice of q and k, so the q/k norms
all-reduce each token's sum of squares over the ranks (`ProjectionRMSNorm`): the RMS is that of
the full projection, as HF computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker import parallel
from engine.worker.attention import AttentionMetadata
from engine.worker.models.layers import RMSNorm, RotaryEmbedding, rms_norm_heads_
from engine.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class ProjectionRMSNorm(RMSNorm):
    """An RMSNorm over a whole column-parallel projection of `full_dim` features of which this
    rank holds the contiguous slice `rank * dim : (rank + 1) * dim` (its heads); its weight is
    that slice of the checkpoint's, cut by `weight_loader`."""

    def __init__(self, full_dim: int, eps: float):
        self.tp_size, self.tp_rank = parallel.world_size(), parallel.rank()
        super().__init__(full_dim // self.tp_size, eps)
        self.full_dim = full_dim
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.copy_(loaded.narrow(0, self.tp_rank * size, size))


def norm_projections_(norms: tuple[ProjectionRMSNorm, ...], xs: tuple[torch.Tensor, ...]) -> None:
    """Normalise each row of each x in `xs` ([T, dim], views of the qkv output) in place by its
    norm in `norms`, over the norm's `full_dim` features across the ranks.

    One rank: the RMSNorm itself (its fused op where on). Several: each token's sums of squares
    of all `xs` in one all-reduce, then x * rsqrt(sum / full_dim + eps) * weight in float32
    (HF's Olmo2RMSNorm: the cast back to x's dtype comes last)."""
    if norms[0].tp_size == 1:
        for norm, x in zip(norms, xs):
            rms_norm_heads_(norm, x)
        return
    sums = torch.stack([x.float().square().sum(-1) for x in xs], dim=-1)  # [T, len(xs)]
    parallel.all_reduce(sums)
    for i, (norm, x) in enumerate(zip(norms, xs)):
        scale = torch.rsqrt(sums[:, i : i + 1] / norm.full_dim + norm.eps)
        x.copy_(norm.weight.float() * (x.float() * scale))


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.q_norm = ProjectionRMSNorm(heads * self.head_size, config.rms_norm_eps)
        self.k_norm = ProjectionRMSNorm(kv_heads * self.head_size, config.rms_norm_eps)

    def forward(self, positions, x, meta: AttentionMetadata, kv_cache, rows=None):
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        norm_projections_((self.q_norm, self.k_norm), (q, k))
        self.rotary(positions, q.view(T, self.num_heads, self.head_size), k.view(T, self.num_kv_heads, self.head_size))
        o = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        # NOTE: OLMo 2 has no norm before its sublayers; left in, the loader would ask the
        # checkpoint for a weight it does not have.
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta, kv_cache, rows=None):
        """Llama's contract: the hidden state is x + residual (residual None: x alone), and so is
        the result (LlamaModel's final norm adds the two). Here the result is
        (post_feedforward_layernorm(mlp(h)), h) with h = hidden + post_attention_layernorm(attn)."""
        hidden = x if residual is None else x + residual
        a, _ = self.post_attention_layernorm(self.self_attn(positions, hidden, meta, kv_cache, rows))
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        h = hidden + a
        m, _ = self.post_feedforward_layernorm(self.mlp(h))
        return m, h


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
    compiled_stack_unsupported = ("OLMo 2's whole-projection query and key norms and its norms after the sublayers "
                                  "are not in the compiled stack")
