"""Gemma 3, text only (HF's Gemma3ForCausalLM with a Gemma3TextConfig): Gemma 2's layers
(engine/worker/models/gemma.py) with

- a (1 + w) RMSNorm over each head of the queries and of the keys, before the rotary embedding
  (as Qwen3's q_norm / k_norm);
- two rotary tables: the "sliding_attention" layers rotate with their own parameters (the local
  base, rope_local_base_freq, 10k by default), the "full_attention" layers with the global ones
  (and their scaling): `rope_parameters` per layer type;
- no attention soft-cap (HF's Gemma 3 attention never applies attn_logit_softcapping).
"""

from __future__ import annotations

from engine.worker.models.gemma import (
    GemmaAttention,
    GemmaDecoderLayer,
    GemmaModel,
    GemmaRMSNorm,
    Gemma2ForCausalLM,
)
from engine.worker.models.layers import RotaryEmbedding
from engine.worker.models.qwen3 import Qwen3Attention


class Gemma3Attention(GemmaAttention, Qwen3Attention):
    """Gemma's scale and window (GemmaAttention), Qwen3's per-head norms and forward
    (Qwen3Attention) with Gemma's norm; `rotary` is a dict: layer type -> table."""

    norm_cls = GemmaRMSNorm
    uses_attn_softcap = False

    def __init__(self, config, rotary: dict[str, RotaryEmbedding], layer_idx: int = 0):
        # NOTE: MRO Gemma3Attention -> GemmaAttention -> Qwen3Attention -> LlamaAttention: Qwen3's
        # constructor adds the norms, then Gemma's replaces the attention layer.
        super().__init__(config, rotary[config.layer_types[layer_idx]], layer_idx)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(GemmaModel):
    layer_cls = Gemma3DecoderLayer

    def make_rotary(self, config, head_size: int, max_positions: int) -> dict[str, RotaryEmbedding]:
        """One table per layer type, each shared by the layers of that type."""
        return {t: RotaryEmbedding(config, head_size, max_positions, layer_type=t) for t in sorted(set(config.layer_types))}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    compiled_stack_unsupported = ("Gemma 3's four norms per layer, (1 + w) norms, per-head q/k norms, GELU MLP, "
                                  "two rotary tables and sliding windows are not in the compiled stack")
