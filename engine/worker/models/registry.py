"""The model registry: which HF architecture names we serve, with which model class.

One file per family under engine/worker/models/ holds its classes, built on llama.py's layers;
this module only maps names to them and checks, before any weight is read, that a config asks
for nothing its family's class does not implement (`check_config`).
"""

from __future__ import annotations

import logging

from torch import nn

from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.models.mixtral import MixtralForCausalLM
from engine.worker.models.qwen3 import Qwen3ForCausalLM
from engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM

logger = logging.getLogger(__name__)

# architecture name (a config's `architectures`) -> model class
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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
    the whole context (Qwen2/Qwen3 configs carry a window that `use_sliding_window` turns off)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_config(hf_config, max_model_len: int, max_model_len_asked: bool) -> int:
    """Check what `hf_config` asks of its family's class; returns the max_model_len to serve.

    NOTE: attention here reads every earlier token. Within a sliding window that is the same
    attention, so a model with a window of W tokens is served with a context of at most W (as
    vLLM served such models on backends without windowed attention) rather than silently
    attending past its window: a longer --max-model-len is refused, the model's default is cut
    to W with a log line."""
    arch = architecture(hf_config)
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModelError(f"rope_type {rope_type!r} of {arch} is not one we compute; known: "
                                        f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    check_experts(hf_config)
    window = sliding_window(hf_config)
    if window is not None and window < max_model_len:
        if max_model_len_asked:
            raise UnsupportedModelError(
                f"max_model_len {max_model_len} exceeds the model's sliding_window {window}: {arch}'s sliding-window "
                f"attention is served only within one window here; pass --max-model-len {window} or less"
            )
        logger.info("max_model_len %d -> %d: %s's sliding_window (attention within one window is the whole "
                    "context's)", max_model_len, window, arch)
        return window
    return max_model_len


def check_experts(hf_config) -> None:
    """A mixture of experts' config (its class's `expert_fields`) needs at least one expert and
    1 <= experts per token <= experts; UnsupportedModelError naming the field otherwise.

    NOTE: HF's Qwen3-MoE with num_experts 0 is all dense layers, i.e. Qwen3 with another
    class; it is refused rather than served, as a config that says MoE and has no experts is
    more likely a mistake than a dense model."""
    arch = architecture(hf_config)
    fields = model_class(hf_config).expert_fields
    if fields is None:
        return
    experts_field, top_k_field = fields
    experts, top_k = getattr(hf_config, experts_field, None), getattr(hf_config, top_k_field, None)
    if not isinstance(experts, int) or experts < 1:
        raise UnsupportedModelError(f"{experts_field} {experts!r} of {arch}: a mixture of experts needs at least one "
                                    "expert")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"{top_k_field} {top_k!r} of {arch} must be between 1 and {experts_field} "
                                    f"({experts})")
