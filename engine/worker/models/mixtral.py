"""Mixtral: Mistral's attention (Llama's) with a sparse mixture of experts in every layer's
place of the MLP (engine/worker/models/moe.py): `num_local_experts` experts of
`intermediate_size`, the top `num_experts_per_tok` per token, their softmax weights always
renormalised and kept in float32 (HF's MixtralTopKRouter).

The checkpoint names a layer's block `block_sparse_moe` and an expert's gate, down and up
projections `w1`, `w2`, `w3`; here the block is the layer's `mlp` (the Llama layer's forward
calls it) and an expert is a `LlamaMLP`, so the loader renames them (`renamed_modules`,
`packed_modules`).
"""

from __future__ import annotations

import torch

from engine.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from engine.worker.models.moe import SparseMoE


class MixtralSparseMoE(SparseMoE):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__(config, num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                         intermediate_size=config.intermediate_size, norm_topk_prob=True,
                         weights_dtype=torch.float32)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralSparseMoE


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    compiled_stack_unsupported = "a mixture of experts is not in the compiled stack"
    # checkpoint (num_experts, top-k) fields, checked at start-up (registry.check_config)
    expert_fields = ("num_local_experts", "num_experts_per_tok")
    renamed_modules = {"block_sparse_moe": "mlp"}
    packed_modules = LlamaForCausalLM.packed_modules | {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }
