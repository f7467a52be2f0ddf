"""Each served family's GGUF layout, as llama.cpp's convert_hf_to_gguf.py writes it: its GGUF
architecture name, the config fields its metadata gives (`family_fields`), and its tensors, which
module or parameter of ours each fills and with what shape (`linear_groups`, `norm_tensors`,
`tensor_shapes`). gguf_file.py reads the metadata common to all, gguf_weights.py loads the tensors.

What the families' GGUFs differ in (convert_hf_to_gguf.py's model classes, llama.cpp's
src/llama-model.cpp for what the file leaves out):

- llama, smollm3, granite, and Mixtral (written as arch "llama" with `expert_count`): Q and K
  rows permuted for llama.cpp's rotary (`LlamaModel.permute`), undone at load;
- gemma2 / gemma3: every `*norm.weight` stored as 1 + w (GemmaRMSNorm's scale, which our
  GemmaRMSNorm holds as is), four norms per layer, the LM head always tied (gemma2); the
  sliding-window layer pattern and Gemma 3's local rotary base are llama.cpp's fixed values;
- phi3: q/k/v fused in `attn_qkv`, gate/up fused in `ffn_up`, partial rotary as
  `rope.dimension_count`, longrope as two factor tensors;
- olmo2: no input norms, norms after each sublayer, q/k norms over the whole projection;
- qwen3moe and Mixtral: the router `ffn_gate_inp` and each layer's experts as three 3-D tensors
  `ffn_{gate,up,down}_exps` [experts, rows, K], one 2-D slice per expert; Mixtral GGUFs of the
  older convert.py (before 2024-04) hold each expert's as 2-D tensors `ffn_gate.E` ..., which
  llama.cpp still loads (`split_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass

# GGUF architecture -> our model class name (engine/worker/models/registry.py); "llama" with
# experts is Mixtral (`family_fields`)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
# HF model_type -> transformers config class (GGUFConfig.to_transformers)
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "smollm3": "SmolLM3Config",
                  "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config",
                  "olmo2": "Olmo2Config", "granite": "GraniteConfig", "mixtral": "MixtralConfig",
                  "qwen3_moe": "Qwen3MoeConfig"}
# Architectures with an RMSNorm over each head of the queries and keys (blk.N.attn_q_norm / attn_k_norm)
QK_NORM = ("qwen3", "qwen3moe", "gemma3")
# Architectures whose Q/K rows llama.cpp's convert_hf_to_gguf.py permuted (its `permute`), so
# that its rotary pairs adjacent values; ours (HF's rotate_half) pairs the two halves of a head.
PERMUTED_QK = ("llama", "smollm3", "granite")
GEMMA = ("gemma2", "gemma3")
# SmolLM3's layers without rotary: every 4th, counting from 1 (llama.cpp's fixed n_no_rope_layer_step;
# a GGUF has no field for it)
SMOLLM3_NO_ROPE_STEP = 4
# Gemma's sliding-window layer patterns (llama.cpp's set_swa_pattern: every Nth layer, counting
# from 1, attends to the whole context) and Gemma 3's local rotary base, which a GGUF has no field for
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# The layer counts of the Gemma 27B models, whose attention scale llama.cpp takes as
# (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (their query_pre_attn_scalar)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def transformers_dequantizes(f) -> bool:
    """Whether transformers' GGUF loader builds `f`'s model right (loader.convert_gguf, for
    --quantization none): Llama, Qwen2 and Qwen3 only. NOTE: it reads a Mixtral GGUF (arch llama)
    as a Llama without its experts, Qwen3-MoE's without its expert width, Gemma's without
    query_pre_attn_scalar and the soft-caps, and has no SmolLM3, OLMo 2 or Granite; those are
    dequantized by gguf_weights.py at each start instead."""
    return f.arch in ("llama", "qwen2", "qwen3") and not f.value(f"{f.arch}.expert_count")


@dataclass(frozen=True)
class TensorGroup:
    """One module's weight as GGUF tensors: its row segments in order, and the heads whose rows
    llama.cpp permuted per segment (None: not permuted)."""

    module: str  # dotted path in the model, e.g. "model.layers.3.self_attn.qkv_proj"
    tensors: tuple[str, ...]
    permuted_heads: tuple[int | None, ...]
    biases: tuple[str, ...] = ()  # the segments' biases, if the layer has one
    expert: int | None = None  # the tensors are 3-D [experts, rows, K]: this expert's slice
    dense_only: bool = False  # never kept quantized (a MoE router: a rounded one picks other experts)


def split_experts(tensor_names) -> bool:
    """Whether a GGUF holds its experts as 2-D tensors per expert (`blk.N.ffn_gate.E.weight`)."""
    return "blk.0.ffn_gate.0.weight" in tensor_names


def is_moe(config) -> bool:
    return config.model_type in ("mixtral", "qwen3_moe")


def num_experts(config) -> int:
    return config.num_local_experts if config.model_type == "mixtral" else config.num_experts


def family_fields(f, kwargs: dict) -> dict:
    """The config fields of `f`'s family beyond the common ones in `kwargs` (which it may
    override), model_type and architectures included. `f`: the GGUFFile."""
    a = f.arch
    experts = int(f.value(f"{a}.expert_count", 0) or 0)
    if a == "llama" and experts:
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts,
                    num_experts_per_tok=int(f.need(f"{a}.expert_used_count")), sliding_window=None)
    if a == "qwen3moe":
        # NOTE: llama.cpp renormalises Qwen3-MoE's top-k weights always and has no dense layers
        # (no mlp_only_layers); a GGUF has no field for either
        return dict(model_type="qwen3_moe", num_experts=experts,
                    num_experts_per_tok=int(f.need(f"{a}.expert_used_count")),
                    moe_intermediate_size=int(f.need(f"{a}.expert_feed_forward_length")),
                    norm_topk_prob=bool(f.value(f"{a}.expert_weights_norm", True)),
                    decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
    if a == "smollm3":
        layers, step = kwargs["num_hidden_layers"], SMOLLM3_NO_ROPE_STEP
        return dict(model_type=a, no_rope_layers=[int((i + 1) % step != 0) for i in range(layers)],
                    no_rope_layer_interval=step, use_sliding_window=False, sliding_window=None)
    if a in GEMMA:
        return _gemma_fields(f, kwargs)
    if a == "phi3":
        window = f.value(f"{a}.attention.sliding_window")
        # NOTE: llama.cpp ignores Phi-3's window (its "Phi SWA is currently disabled"); HF applies
        # it, and HF's are the floats we serve
        return dict(model_type=a, sliding_window=int(window) if window else None,
                    original_max_position_embeddings=int(f.value(f"{a}.rope.scaling.original_context_length",
                                                                 kwargs["max_position_embeddings"])))
    if a == "granite":
        return dict(model_type=a, attention_multiplier=float(f.need(f"{a}.attention.scale")),
                    embedding_multiplier=float(f.need(f"{a}.embedding_scale")),
                    residual_multiplier=float(f.need(f"{a}.residual_scale")),
                    logits_scaling=float(f.need(f"{a}.logit_scale")), mlp_bias=False)
    if a in ("qwen2", "qwen3", "olmo2"):
        return dict(model_type=a)
    return dict(model_type="llama")


def _gemma_fields(f, kwargs: dict) -> dict:
    a, layers = f.arch, kwargs["num_hidden_layers"]
    every = GEMMA_SWA_PATTERN[a]
    heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
    scalar = hidden // heads if layers == GEMMA_27B_LAYERS[a] else kwargs["head_dim"]
    final_cap = f.value(f"{a}.final_logit_softcapping")
    fields = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                  sliding_window=int(f.need(f"{a}.attention.sliding_window")), attention_bias=False,
                  layer_types=["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
                  final_logit_softcapping=float(final_cap) if final_cap else None)
    if a == "gemma2":
        cap = f.value(f"{a}.attn_logit_softcapping")
        return fields | dict(model_type="gemma2", attn_logit_softcapping=float(cap) if cap else None,
                             tie_word_embeddings=True)
    local = float(f.value(f"{a}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": local},
            "full_attention": kwargs["rope_parameters"]}
    return fields | dict(model_type="gemma3_text", attn_logit_softcapping=None, rope_parameters=rope)


def _layer_norms(config, arch: str, i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer i's norms: GGUF name -> (our parameter name, shape)."""
    b, m, hidden = f"blk.{i}.", f"model.layers.{i}.", (config.hidden_size,)
    hd = config.head_dim
    if arch == "olmo2":
        q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        return {b + "post_attention_norm.weight": (m + "post_attention_layernorm.weight", hidden),
                b + "post_ffw_norm.weight": (m + "post_feedforward_layernorm.weight", hidden),
                b + "attn_q_norm.weight": (m + "self_attn.q_norm.weight", (q,)),
                b + "attn_k_norm.weight": (m + "self_attn.k_norm.weight", (kv,))}
    norms = {b + "attn_norm.weight": (m + "input_layernorm.weight", hidden)}
    if arch in GEMMA:
        norms |= {b + "post_attention_norm.weight": (m + "post_attention_layernorm.weight", hidden),
                  b + "ffn_norm.weight": (m + "pre_feedforward_layernorm.weight", hidden),
                  b + "post_ffw_norm.weight": (m + "post_feedforward_layernorm.weight", hidden)}
    else:
        norms[b + "ffn_norm.weight"] = (m + "post_attention_layernorm.weight", hidden)
    if arch in QK_NORM:
        norms |= {b + "attn_q_norm.weight": (m + "self_attn.q_norm.weight", (hd,)),
                  b + "attn_k_norm.weight": (m + "self_attn.k_norm.weight", (hd,))}
    return norms


def norm_tensors(config, arch: str) -> dict[str, str]:
    """GGUF name -> parameter name of the norm weights (loaded as stored: Gemma's hold 1 + w)."""
    names = {"output_norm.weight": "model.norm.weight"}
    for i in range(config.num_hidden_layers):
        names |= {g: p for g, (p, _) in _layer_norms(config, arch, i).items()}
    return names


def linear_groups(config, arch: str, split: bool = False) -> list[TensorGroup]:
    """The decoder's linear layers (and MoE routers), in file order; `split`: experts as 2-D
    tensors per expert (`split_experts`)."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    perm = arch in PERMUTED_QK
    biased = config.attention_bias or config.model_type == "qwen2"
    groups = []
    for i in range(config.num_hidden_layers):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        if arch == "phi3":
            groups.append(TensorGroup(m + "self_attn.qkv_proj", (b + "attn_qkv.weight",), (None,)))
        else:
            qkv = tuple(b + f"attn_{x}.weight" for x in "qkv")
            groups.append(TensorGroup(m + "self_attn.qkv_proj", qkv, (heads if perm else None, kv if perm else None,
                                                                       None),
                                      tuple(n.replace(".weight", ".bias") for n in qkv) if biased else ()))
        groups.append(TensorGroup(m + "self_attn.o_proj", (b + "attn_output.weight",), (None,),
                                  (b + "attn_output.bias",) if config.attention_bias else ()))
        if is_moe(config):
            groups.append(TensorGroup(m + "mlp.gate", (b + "ffn_gate_inp.weight",), (None,), dense_only=True))
            for e in range(num_experts(config)):
                x = f"{m}mlp.experts.{e}."
                names = _expert_tensors(b, e, split)
                groups += [TensorGroup(x + "gate_up_proj", names[:2], (None, None), expert=None if split else e),
                           TensorGroup(x + "down_proj", names[2:], (None,), expert=None if split else e)]
            continue
        gate_up = (b + "ffn_up.weight",) if arch == "phi3" else (b + "ffn_gate.weight", b + "ffn_up.weight")
        groups += [TensorGroup(m + "mlp.gate_up_proj", gate_up, (None,) * len(gate_up)),
                   TensorGroup(m + "mlp.down_proj", (b + "ffn_down.weight",), (None,))]
    return groups


def _expert_tensors(b: str, e: int, split: bool) -> tuple[str, str, str]:
    """Expert e's gate, up and down tensors in layer prefix `b` ("blk.N.")."""
    if split:
        return b + f"ffn_gate.{e}.weight", b + f"ffn_up.{e}.weight", b + f"ffn_down.{e}.weight"
    return b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight", b + "ffn_down_exps.weight"


def tensor_shapes(config, arch: str, split: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads -> its shape (PyTorch order), as the config implies."""
    hidden, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    want = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        want["output.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        want |= {g: shape for g, (_, shape) in _layer_norms(config, arch, i).items()}
        if arch == "phi3":
            want |= {b + "attn_qkv.weight": (q + 2 * kv, hidden), b + "ffn_up.weight": (2 * inter, hidden)}
        else:
            want |= {b + "attn_q.weight": (q, hidden), b + "attn_k.weight": (kv, hidden),
                     b + "attn_v.weight": (kv, hidden)}
        want[b + "attn_output.weight"] = (hidden, q)
        if config.attention_bias or config.model_type == "qwen2":
            want |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if config.attention_bias:
            want[b + "attn_output.bias"] = (hidden,)
        if is_moe(config):
            n = num_experts(config)
            e_inter = config.moe_intermediate_size if config.model_type == "qwen3_moe" else inter
            want[b + "ffn_gate_inp.weight"] = (n, hidden)
            for e in range(n if split else 1):
                gate, up, down = _expert_tensors(b, e, split)
                lead = () if split else (n,)
                want |= {gate: lead + (e_inter, hidden), up: lead + (e_inter, hidden), down: lead + (hidden, e_inter)}
        elif arch != "phi3":
            want |= {b + "ffn_gate.weight": (inter, hidden), b + "ffn_up.weight": (inter, hidden)}
        if not is_moe(config):
            want[b + "ffn_down.weight"] = (hidden, inter)
    return want
