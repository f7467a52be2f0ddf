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
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
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
