"""Gemma 2 (HF's Gemma2ForCausalLM), and the pieces Gemma 3 (engine/worker/models/gemma3.py)
shares, on llama.py's layers. What differs from Llama, as HF's modeling_gemma2.py computes it:

- RMSNorm scales by (1 + w), in fp32 (`GemmaRMSNorm`: 1 + w folded into the weight at load);
- the embedding is scaled by sqrt(hidden), that factor cast to the model dtype first;
- the MLP is gelu_pytorch_tanh(gate) * up;
- four norms per layer: input, post_attention (on the attention's output, before the residual
  add), pre_feedforward and post_feedforward (on the MLP's output, before the residual add);
- the attention scale is query_pre_attn_scalar ** -0.5; scores are soft-capped by
  attn_logit_softcapping; "sliding_attention" layers (`layer_types`) see the last
  sliding_window positions only (PagedAttention computes both);
- the logits are soft-capped by final_logit_softcapping;
- the LM head is tied to the embedding (tie_word_embeddings, true in Gemma's configs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention import AttentionMetadata, PagedAttention
from engine.worker.models.layers import MergedColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from engine.worker.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    layer_sliding_window,
)

# The MLP activations we compute (HF's ACT2FN names): both are tanh-approximated GELU.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(RMSNorm):
    """HF's GemmaRMSNorm: x / rms(x) * (1 + w), in fp32, rounded once to x's dtype.

    NOTE: `weight` holds 1 + w: the loader folds it in (the sum in fp32), so in float32 the
    shared RMSNorm (its fused op included) computes HF's floats as they are. In bf16/fp16 the
    product is taken in fp32 as HF takes it, but the folded weight is stored in the model dtype,
    so 1 + w carries one rounding HF's (1.0 + w.float()) does not: exact in fp32 only."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.copy_(1.0 + loaded.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm.forward: (normed, x + residual); may overwrite x and residual in fp32."""
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype), x


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one product."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, the layer's window and the attention soft-cap."""

    # Whether attn_logit_softcapping applies (HF's Gemma 3 reads it from its config but never
    # passes it to the attention).
    uses_attn_softcap = True

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        cap = getattr(config, "attn_logit_softcapping", None) if self.uses_attn_softcap else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size,
                                   config.query_pre_attn_scalar**-0.5,
                                   sliding_window=layer_sliding_window(config, layer_idx),
                                   logit_softcap=float(cap) if cap else None)


class GemmaDecoderLayer(LlamaDecoderLayer):
    attention_cls = GemmaAttention
    mlp_cls = GemmaMLP

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, x, residual, meta: AttentionMetadata, kv_cache, rows=None):
        """As LlamaDecoderLayer.forward: (this layer's output, the residual it is to be added
        to), the sum left to the next layer's input norm (or the final norm)."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, kv_cache, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        x, _ = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x, _ = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self.hidden_size = config.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # NOTE: sqrt(hidden) in fp32, then in the model dtype, as HF's scaled embedding casts it
        # (in bf16, sqrt(3072) = 55.43 becomes 55.5; the checkpoints were trained so).
        return x * torch.tensor(self.hidden_size**0.5, dtype=torch.float32).to(x.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    compiled_stack_unsupported = ("Gemma's four norms per layer, (1 + w) norms, GELU MLP, attention soft-cap and "
                                  "sliding windows are not in the compiled stack")

    @classmethod
    def config_refusal(cls, config) -> str | None:
        """What this module does not compute: another MLP activation, attention biases (HF's
        Gemma puts one on o_proj too), bidirectional attention."""
        arch = (getattr(config, "architectures", None) or [cls.__name__])[0]
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in GELU_TANH:
            return f"hidden_activation {act!r} of {arch} is not one we compute; known: {', '.join(GELU_TANH)}"
        if getattr(config, "attention_bias", False):
            return f"attention_bias true of {arch} is not served (biases on q/k/v/o)"
        if getattr(config, "use_bidirectional_attention", False):
            return f"use_bidirectional_attention true of {arch} is not served (causal only)"
        return None

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcap = float(cap) if cap else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, soft-capped as HF's: c * tanh(logits / c)."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
