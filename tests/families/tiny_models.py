"""Tiny random-weight models of each family we serve, built from the family's own transformers
config and model classes and saved as safetensors, for the equality tests (test_families.py).

Each has a few layers, a small hidden size, GQA where the family has it, and norms and biases
drawn away from HF's initial 1 and 0 so that they count. The tokenizer is the default model's
(token ids below the tiny vocabulary are all the tests use)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              # NOTE: HF's default init (std 0.02) leaves a model this small attending almost
              # uniformly, where greedy tokens do not see the attention's scale or which features
              # rotate; at 0.1 they do (a full-head rotary for Phi-4-mini's partial one, or
              # Llama's scale for Granite's, changes every prompt's tokens)
              initializer_range=0.1)

# family -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # NOTE: every 2nd layer NoPE: layers 0 and 2 rotate q/k, layer 1 does not (no_rope_layers
    # [1, 0, 1]); embeddings tied, as SmolLM3's are by default. Weights of std 0.2, not HF's
    # 0.02: at 0.02 attention is near-uniform and greedy tokens are the same with the rotary
    # embedding on every layer, so the test would not see a NoPE layer rotated.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                {"no_rope_layer_interval": 2, "tie_word_embeddings": True, "initializer_range": 0.2}),
    # fused qkv_proj / gate_up_proj in the checkpoint
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # and rotary over the first 12 of each head's 16 features, the LM head tied (as Phi-4-mini)
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
    # each multiplier away from 1 and the attention scale away from head_dim ** -0.5 (0.25)
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 6.0, "attention_multiplier": 0.6, "residual_multiplier": 0.4, "logits_scaling": 3.0}),
    # NOTE: windows shorter than the tests' contexts (prompts up to 70 tokens + 12 new), mixed
    # sliding and full layers, soft-caps small enough to bend these tiny models' scores, weights
    # drawn wider than HF's 0.02 so that the scores are not all near 0, tied embeddings
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 5.0, "initializer_range": 0.1, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 24, "query_pre_attn_scalar": 16, "final_logit_softcapping": 5.0,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}},
                "initializer_range": 0.1, "tie_word_embeddings": True}),
    # NOTE: 4 experts, top-2: every expert is chosen by some tokens and left out by others.
    # Weights drawn 5x wider than HF's 0.02: at 0.02 a MoE block's output is ~0.2% of its
    # input's norm, and scaling the tiny Qwen3-MoE's by 0.9 (or skipping its tensor-parallel
    # all-reduce) left every greedy token as it was; at 0.1 it is ~30% and such errors show.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                         "sliding_window": None, "initializer_range": 0.1}),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; experts of another width than the
    # dense MLP's; top-k weights renormalised
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                           "moe_intermediate_size": 48, "norm_topk_prob": True,
                                                           "mlp_only_layers": [1], "initializer_range": 0.1}),
}


def build(family: str, seed: int = 0, **overrides):
    """A random-weight HF model of `family` (float32, eval mode)."""
    import transformers

    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**(COMMON | kw | overrides))
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval()


def save(model, path: Path) -> Path:
    """Save as an HF directory (config.json + model.safetensors); returns it."""
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    return path
