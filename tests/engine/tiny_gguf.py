"""Tiny random-weight HF models and GGUF files written from them the way llama.cpp's
convert_hf_to_gguf.py writes them (Llama Q/K rows permuted for its rotary), for the GGUF tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from engine.worker.models.gguf_file import PERMUTED_QK

# K = 256 and 512 hold whole blocks of every type (the K-quants' are 256 values)
TINY = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


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


def gguf_tensors(model, arch: str = "llama") -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as convert_hf_to_gguf.py would hand them to the writer."""
    c = model.config
    out = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = a
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{_LAYER_NAMES[module]}.{kind}"
            if arch in PERMUTED_QK and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
                a = llama_cpp_permute(a, heads)
            out[gname] = a
    return out


def write_gguf(path: Path, model, arch: str = "llama", types: dict[str, str] | None = None,
               drop: tuple[str, ...] = (), wrong_bytes: str | None = None, gguf_arch: str | None = None) -> Path:
    """Write `model` as a GGUF. `types`: tensor-name fragment -> GGML type name for 2-D tensors
    (first match wins; default F32); 1-D tensors are F32. `drop`: tensors left out. `wrong_bytes`:
    a tensor written as F16 bytes while its header says F32 (its byte size disagrees). Llama 3's
    rope scaling is written as convert_hf_to_gguf.py writes it: a rope_freqs.weight tensor."""
    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), gguf_arch or arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, c.head_dim))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    for name, a in gguf_tensors(model, arch).items():
        if name in drop:
            continue
        if name == wrong_bytes:
            w.add_tensor(name, a.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F32)
            continue
        qtype = "F32"
        if a.ndim == 2:
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
