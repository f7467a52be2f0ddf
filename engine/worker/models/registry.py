"""The model registry: which HF architecture names we serve, with which model class.

One file per family under engine/worker/models/ holds its classes, built on llama.py's layers;
this module only maps names to them and checks, before any weight is read, that a config asks
for nothing its family's class does not implement (`check_config`).
"""

from __future__ import annotations

from torch import nn

from engine.worker.models.gemma import GELU_TANH, Gemma2ForCausalLM
from engine.worker.models.gemma3 import Gemma3ForCausalLM
from engine.worker.models.llama import LlamaForCausalLM, config_sliding_window
from engine.worker.models.qwen3 import Qwen3ForCausalLM

# architecture name (a config's `architectures`) -> model class
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class UnsupportedModelError(ValueError):
    """A config that asks for what its family's class does not implement; the message is one
    line naming the field (start-up logs it as is and stops)."""


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def describe_architectures() -> str:
    """One line per architecture: its name and the module of its model class."""
    width = max(map(len, ARCHITECTURES))
    return "".join(f"{name:<{width}}  {ARCHITECTURES[name].__module__}\n" for name in supported_architectures())


def architecture(hf_config) -> str:
    """The first of the config's architectures we serve; ValueError naming them otherwise (a
    config without any is a Llama, as our dummy-weight configs are)."""
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"unsupported architecture {', '.join(archs)}; supported: {', '.join(supported_architectures())} "
        "(paged-serve --list-architectures)")


def model_class(hf_config) -> type[nn.Module]:
    return ARCHITECTURES[architecture(hf_config)]


def sliding_window(hf_config) -> int | None:
    """The window of a config's sliding-window attention, or None when every layer attends to
    the whole context (Qwen2/Qwen3 configs carry a window that `use_sliding_window` turns off).
    Which layers it applies to: llama.layer_sliding_window."""
    return config_sliding_window(hf_config)


# The layer types (a config's `layer_types`) whose attention we compute.
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_config(hf_config, max_model_len: int, max_model_len_asked: bool) -> int:
    """Check what `hf_config` asks of its family's class (UnsupportedModelError naming the field
    otherwise); returns the max_model_len to serve.

    NOTE: every family's attention honours a sliding window per layer (PagedAttention's
    `sliding_window`, set by llama.layer_sliding_window), so a window no longer cuts the context
    (it used to be served within one window, where attending to all was the window's attention).
    `max_model_len_asked` stays for checks that depend on it."""
    arch = architecture(hf_config)
    _check_rope(hf_config, arch)
    types = getattr(hf_config, "layer_types", None)
    unknown = sorted(set(types or ()) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer_types {', '.join(unknown)} of {arch} are not attention we compute; "
                                    f"known: {', '.join(LAYER_TYPES)}")
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        _check_gemma(hf_config, arch)
    return max_model_len


def _check_rope(hf_config, arch: str) -> None:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    # NOTE: Gemma 3's rope_parameters hold one set per layer type
    sets = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in sets:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedModelError(f"rope_type {rope_type!r} of {arch} is not one we compute; known: "
                                            f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")


def _check_gemma(hf_config, arch: str) -> None:
    """What engine/worker/models/gemma.py does not compute: another MLP activation, attention
    biases (HF's Gemma puts one on o_proj too), bidirectional attention."""
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act not in GELU_TANH:
        raise UnsupportedModelError(f"hidden_activation {act!r} of {arch} is not one we compute; known: "
                                    f"{', '.join(GELU_TANH)}")
    if getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError(f"attention_bias true of {arch} is not served (biases on q/k/v/o)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"use_bidirectional_attention true of {arch} is not served (causal only)")
