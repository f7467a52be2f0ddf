"""Tiny random-weight HF models and GGUF files written from them the way llama.cpp's
convert_hf_to_gguf.py writes them: its tensor names (gguf-py's tensor map, as the converter maps
them), Llama-like Q/K rows permuted for its rotary, Gemma's norms stored as 1 + w, Phi-3's fused
q/k/v and gate/up kept fused, each layer's experts stacked into 3-D tensors, and each family's
metadata keys, for the GGUF tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

# K = 256 and 512 hold whole blocks of every type (the K-quants' are 256 values)
TINY = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# NOTE: the converter's rules are spelled out here, not imported from the loader, so that a loader
# whose rules are wrong fails these tests. Architectures whose Q/K rows it permutes (its LlamaModel
# and subclasses: Llama, Mixtral, SmolLM3, Granite) and whose norms it stores as 1 + w (Gemma's)
PERMUTED_QK = ("llama", "smollm3", "granite")
NORM_PLUS_ONE = ("gemma2", "gemma3")
# tensors convert_hf_to_gguf.py keeps in F32 whatever the type asked (its MoE routers among them)
_F32_ALWAYS = ("ffn_gate_inp",)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random-weight LlamaForCausalLM / Qwen2ForCausalLM (float32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = TINY | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} | overrides
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval()


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of a Q or K weight or bias)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str = "llama", split_experts: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as convert_hf_to_gguf.py would hand them to the writer (with
    `split_experts`, each expert's as 2-D tensors `blk.N.ffn_gate.E.weight`, as Mixtral GGUFs of
    llama.cpp's older convert.py hold them)."""
    c = model.config
    names = gguf.get_tensor_name_map(_model_arch(arch), c.num_hidden_layers)
    out = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "lm_head.weight" and (c.tie_word_embeddings or arch == "gemma2"):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, rows, K], gate and up fused
            b = name.split(".")[2]
            parts = dict(zip(("gate", "up"), np.split(a, 2, axis=1))) if name.endswith("gate_up_proj") else {"down": a}
            for kind, t in parts.items():
                if split_experts:
                    out |= {f"blk.{b}.ffn_{kind}.{e}.weight": t[e] for e in range(t.shape[0])}
                else:
                    out[f"blk.{b}.ffn_{kind}_exps.weight"] = t
            continue
        base, kind = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{kind}"
        if arch in PERMUTED_QK and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
            a = a + np.float32(1)
        out[gname] = a
    return out


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _family_metadata(w: gguf.GGUFWriter, c, arch: str) -> None:
    """The keys convert_hf_to_gguf.py writes for the family beyond the common ones."""
    if arch in NORM_PLUS_ONE:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        else:  # the global layers' rotary: base and linear scaling
            full = c.rope_parameters["full_attention"]
            w.add_rope_freq_base(full["rope_theta"])
            if full.get("rope_type") == "linear":
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(getattr(c, "original_max_position_embeddings", None)
                                        or c.max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)
        rope = c.rope_parameters
        if rope.get("rope_type") == "longrope":
            factor = c.max_position_embeddings / c.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(1.0 if factor <= 1 else
                                            float(np.sqrt(1 + np.log(factor) / np.log(c.original_max_position_embeddings))))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "granite":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)


def _rotary_dims(c) -> int:
    """convert_hf_to_gguf.py's rope.dimension_count: Phi-3's int(partial_rotary_factor * hidden) // heads."""
    rot = (c.rope_parameters or {}).get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None)
    return c.head_dim if rot is None else int(rot * c.hidden_size) // c.num_attention_heads


def write_gguf(path: Path, model, arch: str = "llama", types: dict[str, str] | None = None,
               drop: tuple[str, ...] = (), wrong_bytes: str | None = None, gguf_arch: str | None = None,
               split_experts: bool = False) -> Path:
    """Write `model` as a GGUF of architecture `arch`. `types`: tensor-name fragment -> GGML type
    name for 2-D and 3-D tensors (first match wins; default F32); 1-D tensors and MoE routers are
    F32. `drop`: tensors left out. `wrong_bytes`: a tensor written as F16 bytes while its header
    says F32 (its byte size disagrees). `split_experts`: see gguf_tensors. Llama 3's rope scaling is written as convert_hf_to_gguf.py
    writes it: a rope_freqs.weight tensor."""
    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), gguf_arch or arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(_rotary_dims(c))
    if "rope_theta" in rope:
        w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, c.head_dim))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    _family_metadata(w, c, arch)
    for name, a in gguf_tensors(model, arch, split_experts).items():
        if name in drop:
            continue
        if name == wrong_bytes:
            w.add_tensor(name, a.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F32)
            continue
        qtype = "F32"
        if a.ndim >= 2 and not any(f in name for f in _F32_ALWAYS):
            qtype = next((t for frag, t in (types or {}).items() if frag in name), "F32")
        t = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_freqs)."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], \
        rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_dequantized(path: Path, name: str) -> torch.Tensor:
    """A tensor of a GGUF file dequantized by gguf-py (float32), in PyTorch's shape."""
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(int(d) for d in reversed(t.shape)))
