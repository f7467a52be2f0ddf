"""IBM Granite (dense; HF's GraniteForCausalLM): Llama's layers with four scalar multipliers from
the config, each applied where HF applies it and as HF computes it (same operation, same
operands, so the same floats):

- `embedding_multiplier`: the token embeddings times it, before the first layer;
- `attention_multiplier`: the attention's softmax scale, in place of head_size ** -0.5;
- `residual_multiplier`: each block's output (attention's, then the MLP's) times it, before
  it is added to the residual stream;
- `logits_scaling`: the logits divided by it.

HF puts biases on q/k/v and o_proj with `attention_bias` and on the MLP with `mlp_bias`; Granite's
released checkpoints have neither and Llama's layers here have no o_proj or MLP biases, so a
config with either is refused (`config_refusal`)."""

from __future__ import annotations

import torch

from engine.worker.attention import AttentionMetadata, PagedAttention
from engine.worker.models.layers import RotaryEmbedding
from engine.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class GraniteAttention(LlamaAttention):
    """Llama's attention with the softmax scale `attention_multiplier`, its output times
    `residual_multiplier` (what the layer adds to the residual stream)."""

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        scale = float(config.attention_multiplier)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size, scale)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions, x, meta: AttentionMetadata, kv_cache, rows=None):
        # NOTE: scaled here, in place on o_proj's fresh output, before the layer's fused norm
        # adds it to the residual (that norm overwrites both with their sum and its output, so
        # the scaling must come first); HF: residual + hidden * m, the same product and sum
        return super().forward(positions, x, meta, kv_cache, rows).mul_(self.residual_multiplier)


class GraniteMLP(LlamaMLP):
    """Llama's MLP, its output times `residual_multiplier` (as GraniteAttention's)."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, x):
        return super().forward(x).mul_(self.residual_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention
    mlp_cls = GraniteMLP


class GraniteModel(LlamaModel):
    """Llama's decoder on the token embeddings times `embedding_multiplier`."""

    layer_cls = GraniteDecoderLayer

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel
    compiled_stack_unsupported = "Granite's embedding, residual and attention multipliers are not in the compiled stack"

    @classmethod
    def config_refusal(cls, config) -> str | None:
        for field in ("attention_bias", "mlp_bias"):
            if getattr(config, field, False):
                return f"{field} of GraniteForCausalLM is not served (Granite's layers here have no such biases)"
        return None

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits divided by `logits_scaling` (a division, as HF: not times 1/s)."""
        return super().compute_logits(hidden) / self.logits_scaling
