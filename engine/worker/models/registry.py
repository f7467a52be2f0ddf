"""The model registry: which HF architecture names we serve, with which model class.

One file per family under engine/worker/models/ holds its classes, built on llama.py's layers;
this module only maps names to them and checks, before any weight is read, that a config asks
for nothing its family's class does not implement (`check_config`).
"""

from __future__ import annotations

import logging

from torch import nn

from engine.worker.models.gemma import Gemma2ForCausalLM
from engine.worker.models.gemma3 import Gemma3ForCausalLM
from engine.worker.models.granite import GraniteForCausalLM
from engine.worker.models.layers import rope_parameters
from engine.worker.models.llama import LlamaForCausalLM, config_sliding_window, layer_sliding_window
from engine.worker.models.mixtral import MixtralForCausalLM
from engine.worker.models.olmo2 import Olmo2ForCausalLM
from engine.worker.models.phi3 import Phi3ForCausalLM
from engine.worker.models.qwen3 import Qwen3ForCausalLM
from engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.worker.models.smollm3 import SmolLM3ForCausalLM

logger = logging.getLogger(__name__)

# architecture name (a config's `architectures`) -> model class
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}

# The layer types (a config's `layer_types`) whose attention we compute.
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    """The first of the config's architectures we serve; UnsupportedModelError naming them
    otherwise (a config without any is a Llama, as our dummy-weight configs are)."""
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
    the whole context: Qwen2/Qwen3/SmolLM3 configs carry a window that `use_sliding_window` turns
    off, and where a config lists `layer_types` (Qwen2/Qwen3's `max_window_layers`, SmolLM3's,
    Gemma's) only a "sliding_attention" layer uses it (llama.layer_sliding_window)."""
    window = config_sliding_window(hf_config)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def layer_windows(hf_config, num_layers: int) -> list[int | None]:
    """Each layer's sliding window as its attention takes it (llama.layer_sliding_window; None:
    the whole context): what the KV layout's groups are made of (engine/core/kv_layout.py)."""
    return [layer_sliding_window(hf_config, i) for i in range(num_layers)]


def check_config(hf_config, max_model_len: int, max_model_len_asked: bool) -> int:
    """Check what `hf_config` asks of its family's class (UnsupportedModelError naming the field
    otherwise); returns the max_model_len to serve.

    NOTE: every family's attention honours a sliding window per layer (PagedAttention's
    `sliding_window`, set by llama.layer_sliding_window), so a window does not cut the context.

    NOTE: "longrope" (Phi-3 128k, Phi-4-mini) does: HF rotates with its short factors while a
    sequence is within original_max_position_embeddings (O) and past O re-rotates the whole
    context with its long factors (dropping the KV cache, `Phi3ForCausalLM.
    prepare_inputs_for_generation`), which a paged cache written token by token cannot do. So it
    is served within O, with the short factors (RotaryEmbedding's, exactly HF's there): a
    longer --max-model-len is refused naming the field, the model's default is cut to O."""
    arch = architecture(hf_config)
    why = model_class(hf_config).config_refusal(hf_config)
    if why is not None:
        raise UnsupportedModelError(why)
    rope = rope_parameters(hf_config)
    # NOTE: Gemma 3's rope_parameters hold one set per layer type
    sets = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in sets:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedModelError(f"rope_type {rope_type!r} of {arch} is not one we compute; known: "
                                            f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
        if rope_type == "longrope":
            max_model_len = _within_longrope_short_range(hf_config, params, arch, max_model_len, max_model_len_asked)
    check_experts(hf_config)
    unknown = sorted(set(getattr(hf_config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer_types {', '.join(unknown)} of {arch} are not attention we compute; "
                                    f"known: {', '.join(LAYER_TYPES)}")
    return max_model_len


def _within_longrope_short_range(hf_config, rope: dict, arch: str, max_model_len: int, asked: bool) -> int:
    """The max_model_len that keeps a longrope model on its short factors (check_config's NOTE)."""
    original = rope.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings",
                                                                       None)
    if original is None:
        raise UnsupportedModelError(f"rope_type 'longrope' of {arch} without original_max_position_embeddings")
    original = int(original)
    if max_model_len <= original:
        return max_model_len
    if asked:
        raise UnsupportedModelError(
            f"max_model_len {max_model_len} exceeds the model's original_max_position_embeddings {original}: {arch}'s "
            f"rope_type 'longrope' is served only with its short factors, within that length; pass --max-model-len "
            f"{original} or less")
    logger.info("max_model_len %d -> %d: %s's longrope is served with its short factors, within "
                "original_max_position_embeddings", max_model_len, original, arch)
    return original


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
