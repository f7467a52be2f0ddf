"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, engine/worker/models/qwen3.py) with a
sparse mixture of experts (engine/worker/models/moe.py) in place of the MLP of some layers:
`num_experts` experts of `moe_intermediate_size`, the top `num_experts_per_tok` per token,
renormalised where `norm_topk_prob`, the weights cast back to the model's dtype (HF's
Qwen3MoeTopKRouter). Which layers are sparse is HF's rule (`is_sparse_layer`); the others have
a dense MLP of `intermediate_size`. Checkpoint names match (`mlp.gate`, `mlp.experts.N.gate_proj`
...).
"""

from __future__ import annotations

from torch import nn

from engine.worker.models.llama import LlamaMLP
from engine.worker.models.moe import SparseMoE
from engine.worker.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has the experts (else a dense MLP), as Qwen3MoeDecoderLayer
    decides: not in `mlp_only_layers`, experts at all, and every `decoder_sparse_step`-th layer
    (counting from 1)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeSparseMoE(SparseMoE):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__(config, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                         intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob)


def qwen3_moe_mlp(config, layer_idx: int = 0) -> nn.Module:
    """Layer `layer_idx`'s MLP: the experts or a dense one (`is_sparse_layer`)."""
    if is_sparse_layer(config, layer_idx):
        return Qwen3MoeSparseMoE(config, layer_idx)
    return LlamaMLP(config, layer_idx)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    # NOTE: a function, not a class: the layer index picks the class. staticmethod, so that
    # `self.mlp_cls(config, layer_idx)` does not pass the layer as the config.
    mlp_cls = staticmethod(qwen3_moe_mlp)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
    compiled_stack_unsupported = "a mixture of experts is not in the compiled stack"
    expert_fields = ("num_experts", "num_experts_per_tok")
