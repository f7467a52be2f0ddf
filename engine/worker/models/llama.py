"""The Llama family (Llama, SmolLM, Qwen2, Mistral) over a paged KV cache, and the layers the
other families (engine/worker/models/registry.py) build on.

Parameter names match HF checkpoints (`model.layers.N.self_attn.q_proj` ...) except that q/k/v
and gate/up are fused; `packed_modules` tells the loader where each checkpoint tensor goes.
Qwen2 differs only by biases on q/k/v, Mistral not at all; a sliding window (Mistral's on every
layer, Qwen2's on the layers its `layer_types` name) is honoured per layer (`layer_sliding_window`).

Another family subclasses what differs and names it in a class attribute one level up:
`LlamaDecoderLayer.attention_cls` / `.mlp_cls`, `LlamaModel.layer_cls`,
`LlamaForCausalLM.model_cls`. A subclass that the compiled decoder stack does not compute sets
`LlamaForCausalLM.compiled_stack_unsupported` to the reason, which the start-up log prints. Two
hooks take the rest: `LlamaModel.embed` (what the first layer takes) and
`LlamaForCausalLM.config_refusal` (config fields the family does not implement).

On a pipeline-parallel rank the model is built with its stage's modules only (engine/worker/
stage_layout.py): the other stages' layers, and the embedding, LM head or final norm where
another stage holds them, are `MissingLayer`s, which hold no weights.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention import AttentionMetadata, PagedAttention
from engine.worker.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from engine.worker.stage_layout import MissingLayer, StageLayout


def config_sliding_window(config) -> int | None:
    """The window of a config's sliding-window attention, or None when no layer has one (Qwen2/
    Qwen3 configs carry a window that `use_sliding_window` turns off)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx`, as HF's attention takes it: a config with
    `layer_types` (Qwen2/3, Gemma) windows its "sliding_attention" layers only, one without
    (Mistral) every layer; None: the layer attends to the whole context."""
    window = config_sliding_window(config)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[layer_idx] != "sliding_attention"):
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_size = getattr(config, "head_dim", None) or hidden // heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, bias=bias)
        # NOTE: HF Llama, Qwen3, OLMo 2 and SmolLM3 put `attention_bias` on o_proj too; Qwen2
        # and Mistral configs have no such field (their o_proj has none).
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden, bias=getattr(config, "attention_bias", False))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5,
                                   sliding_window=layer_sliding_window(config, layer_idx))

    def forward(self, positions, x, meta: AttentionMetadata, kv_cache, rows=None):
        """Every token's K/V goes to the cache; the output is that of `rows` only (None: all)."""
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        # NOTE: q, k and v stay views of the qkv output (row stride q_size + 2 kv_size); the
        # rotation writes into it, and the attention backend reads strided rows.
        self.rotary(positions, q.view(T, self.num_heads, self.head_size), k.view(T, self.num_kv_heads, self.head_size))
        o = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class LlamaMLP(nn.Module):
    """down(silu(gate x) * up x). `intermediate_size` (default the config's) and `reduce_results`
    (False: each rank returns its partial sum, RowParallelLinear's) serve as one expert of a
    mixture of experts (engine/worker/models/moe.py)."""

    def __init__(self, config, layer_idx: int = 0, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        inter, bias = intermediate_size or config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, feeds_silu_mul=True)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, reduce_results=reduce_results)
        self.act = SiluAndMul()

    def forward(self, x):
        # NOTE: with the fused ops on, the panels kernel applies SiLU * up as the gate/up
        # product's epilogue (same floats, without writing and re-reading the product).
        h = self.gate_up_proj.silu_mul(x) if self.act.fused else None
        if h is None:
            h = self.act(self.gate_up_proj(x))
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int = 0):
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary, layer_idx)
        self.mlp = self.mlp_cls(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta, kv_cache, rows=None):
        """`rows`: the token rows to carry past the attention (None: all), in that order."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, kv_cache, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm  # the final norm's

    def __init__(self, config, max_positions: int):
        """The decoder; on a pipeline stage its modules only (the module docstring)."""
        super().__init__()
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = self.make_rotary(config, head_size, max_positions)
        stage = StageLayout.of_this_rank(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.first
                             else MissingLayer())
        # NOTE: a MissingLayer keeps every layer's index, so that parameter names (what the
        # loaders match and the dummy weights are seeded by) are the same at any P
        self.layers = nn.ModuleList(self.layer_cls(config, rotary, i) if i in stage.layers else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps) if stage.last else MissingLayer()
        # The layers below as one compiled call per step, where it applies and gives the same
        # floats (engine/worker/models/decoder_stack.py sets it; None: layer by layer).
        self.compiled_stack = None

    def make_rotary(self, config, head_size: int, max_positions: int):
        """What every layer's constructor gets as `rotary` (one table shared by all layers)."""
        return RotaryEmbedding(config, head_size, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states the first layer takes, [num_tokens, hidden]."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, meta, kv_caches, rows=None):
        x, residual = self.embed(input_ids), None
        stack = self.compiled_stack
        if stack is not None and stack.applies(meta, kv_caches):
            return stack(x, positions, meta, kv_caches, rows)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            # NOTE: past the last layer's attention only the rows whose hidden states are wanted
            # matter (a prompt's other tokens only leave their K/V in the cache), so its o_proj
            # and MLP run on those alone: ~1/num_layers of a long prefill's work. Every kernel
            # here works row by row, so the rows kept get the same floats as without the cut.
            x, residual = layer(positions, x, residual, meta, kv_cache, rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel
    compiled_stack_unsupported: str | None = None  # why ops.decoder_stack cannot run a subclass
    # a checkpoint's module names that differ from ours: each name's `.old.` part becomes `.new.`
    # before `packed_modules` applies (loader.load_weights)
    renamed_modules: dict[str, str] = {}
    # a mixture of experts' config fields (number of experts, experts per token), which
    # registry.check_config checks; None: no experts
    expert_fields: tuple[str, str] | None = None
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def config_refusal(cls, config) -> str | None:
        """Why this class cannot serve `config` exactly (one line naming the field), or None.
        registry.check_config raises it before any weight is read; a family overrides it."""
        return None

    def __init__(self, config, max_positions: int):
        """The model; on a pipeline stage other than the first without the LM head (stage 0
        computes the logits)."""
        super().__init__()
        self.model = self.model_cls(config, max_positions)
        self.tied_parameters: set[str] = set()
        if isinstance(self.model.embed_tokens, MissingLayer):  # the LM head is on the embedding's stage
            self.lm_head = MissingLayer()
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, rows=None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for the flattened batch; with `rows` (int64 token
        indices), those rows' only, in that order ([len(rows), hidden])."""
        return self.model(input_ids, positions, meta, kv_caches, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
