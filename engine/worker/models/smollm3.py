"""SmolLM3 (HF's SmolLM3ForCausalLM): Llama with the rotary embedding left out of some layers
("NoPE" layers).

HF's config lists, per layer, `no_rope_layers[i]`: 1 where layer i *applies* the rotary
embedding, 0 where it does not (the name notwithstanding; HF's SmolLM3Attention sets
`use_rope = config.no_rope_layers[layer_idx]`). Without the list, HF's config builds it from
`no_rope_layer_interval` (every interval-th layer, counting from 1, is NoPE: layers 3, 7, 11 ...
at the default 4), so a config here always carries it.

Its sliding window (`use_sliding_window`, off by default, and `layer_types`) is read by
engine/worker/models/registry.py's `sliding_window`, like every family's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.models.layers import RotaryEmbedding
from engine.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class NoRotaryEmbedding(nn.Module):
    """Stands in for `RotaryEmbedding` in a NoPE layer: leaves q and k as they are."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        return None


class SmolLM3Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__(config, rotary, layer_idx)
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        if not self.use_rope:
            self.rotary = NoRotaryEmbedding()


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_cls = SmolLM3Attention


class SmolLM3Model(LlamaModel):
    layer_cls = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_cls = SmolLM3Model
    compiled_stack_unsupported = ("SmolLM3's layers without rotary embedding (no_rope_layers) are not in the "
                                  "compiled stack")
