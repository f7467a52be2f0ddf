"""Phi-3 and Phi-4-mini (HF's Phi3ForCausalLM): Llama's layers, computed as Llama computes them,
with two differences that live elsewhere:

- the checkpoint holds q/k/v and gate/up already fused (`self_attn.qkv_proj.weight`,
  `mlp.gate_up_proj.weight`, stacked [q; k; v] and [gate; up]), under the names of our fused
  parameters: the loader hands each whole to the fused layer's weight_loader with shard None,
  which splits it into its parts and cuts each for this rank (layers.QKVParallelLinear /
  MergedColumnParallelLinear);
- Phi-4-mini rotates only part of each head (`partial_rotary_factor` 0.75) and Phi-3's 128k
  models use "longrope": both in layers.RotaryEmbedding (longrope within its short range only,
  registry.check_config).

With whole-head rotary the compiled decoder stack computes it as it computes Llama (same ops,
same order); with partial rotary decoder_stack.why_not says no and the Python layers run.
"""

from __future__ import annotations

from engine.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # NOTE: none: the checkpoint's names are already the fused parameters' (a ".q_proj." or
    # ".up_proj." never occurs in them), so every tensor loads whole, with shard None
    packed_modules: dict[str, tuple[str, object]] = {}
