"""A Llama-family model's decoder layers as one compiled call per step, where that gives the
same floats as the layers themselves.

engine/worker/models/llama.py runs a layer as ~20 Python calls (modules, the ops.py wrappers' checks,
the dispatcher, views), each ~10 us of host work on a small CPU: ~6 ms of every step whatever
its batch, a quarter of a one-sequence decode step. `ops.decoder_stack` runs the same kernels in
the same order on tensors of the same shapes in C++ (cuda_ext/csrc/cpu/decoder_stack.cpp);
`CompiledDecoderStack` holds the weights it needs, gathered once after the linear layers are
packed, and hands it each step.

It applies (`why_not` says why not otherwise) to a model on a CPU on one rank (no all-reduce
between the products), with the compiled ops' AVX2 + FMA kernels, the fused elementwise ops on,
every linear layer on one kernel: the panels kernel in fp32 (gate/up packed in pairs), or
oneDNN's packed weights in fp32 or bf16 (what `--dtype auto` takes where the CPU multiplies bf16
natively), or GGUF-quantized weights (QuantLinear, fp32 or bf16 activations); biases on q/k/v at most, per-head q/k norms (Qwen3) or none, and a head size the prefill kernel takes; per step, to
metadata the CPU attention backend built (`applies`). Elsewhere, and with ``--no-fused-ops``,
the layers run in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cuda_ext import ops
from engine.worker.attention import AttentionMetadata
from engine.worker.models.layers import FUSED_MODULES
from engine.worker.models.linear_kernel import PanelWeight, linear_layers
from engine.worker.models.llama import LlamaModel
from engine.worker.models.quant_linear import QuantLinear

# The dtypes the stack's kernels take (the prefill attention kernel's).
_DTYPES = (torch.float32, torch.bfloat16)


def _product_weight(layer: nn.Module) -> Tensor:
    """A linear layer's weight as ops.decoder_stack takes it: its panels, oneDNN's tensor, or
    quant_pack's uint8 tensor (a QuantLinear's)."""
    if isinstance(layer, QuantLinear):
        return layer.qweight
    packed = layer.packed
    return packed.panels if type(packed) is PanelWeight else packed


def _on_onednn(layer: nn.Module) -> bool:
    packed = layer.packed
    return isinstance(packed, Tensor) and packed.is_mkldnn


@dataclass(frozen=True)
class CompiledDecoderStack:
    # per layer, in ops.decoder_stack's order: input norm, qkv, o, post-attention norm, gate/up,
    # down; the products' weights all panels (gate/up in pairs) or all oneDNN's packed tensors
    weights: tuple[Tensor, ...]
    qkv_biases: tuple[Tensor, ...]  # one per layer, or none
    qk_norms: tuple[Tensor, ...]  # per layer the per-head query and key norms (Qwen3's), or none
    final_norm: Tensor
    cos: Tensor
    sin: Tensor
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    scale: float
    eps: float
    # The narrowest sliding window of the layers (None: none has one). When every layer has it
    # (`shared_window`: Mistral's) the kernels compute it; otherwise only a step whose every
    # context fits in it runs, as it attends as without the window.
    window: int | None = None
    shared_window: bool = False

    @classmethod
    def build(cls, model: LlamaModel) -> CompiledDecoderStack:
        """From a `LlamaModel` (the decoder, `LlamaForCausalLM.model`) that `why_not` accepts."""
        weights, biases, qk_norms = [], [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight, _product_weight(attn.qkv_proj), _product_weight(attn.o_proj),
                        layer.post_attention_layernorm.weight, _product_weight(mlp.gate_up_proj),
                        _product_weight(mlp.down_proj)]
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias)
            if hasattr(attn, "q_norm"):
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        first = model.layers[0]
        attn = first.self_attn
        windows = [layer.self_attn.attn.sliding_window for layer in model.layers]
        window = min((w for w in windows if w is not None), default=None)
        shared = window is not None and all(w == window for w in windows)
        return cls(tuple(w.detach() for w in weights), tuple(b.detach() for b in biases),
                   tuple(n.detach() for n in qk_norms), model.norm.weight.detach(),
                   attn.rotary.cos, attn.rotary.sin, attn.num_heads, attn.num_kv_heads,
                   first.mlp.gate_up_proj.out_sizes[0], attn.attn.scale, first.input_layernorm.eps, window, shared)

    def applies(self, meta: AttentionMetadata, kv_caches) -> bool:
        """Whether this step's metadata is the CPU backend's (its prompt chunks for the one-call
        prefill kernel), its caches are of a dtype the kernels take, and no context in it
        outgrows a layer's sliding window unless all layers share it (the kernels compute it)."""
        if self.window is not None and not self.shared_window and (
                meta.max_context_len is None or meta.max_context_len > self.window):
            return False
        return (meta.num_prefill_tokens == 0 or meta.prefill_spans is not None) \
            and kv_caches[0][0].dtype in _DTYPES

    def __call__(self, x: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches, rows: Tensor | None) -> Tensor:
        """`LlamaModel.forward` after the embedding: the normed hidden states of `rows` (None:
        every token). Overwrites x."""
        return ops.decoder_stack(
            x, positions, self.weights, self.qkv_biases, self.qk_norms, self.final_norm, self.cos, self.sin,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping, meta.prefill_tables,
            meta.prefill_spans, meta.num_prefill_tokens, meta.decode_block_tables, meta.decode_context_lens,
            meta.max_decode_context_len, self.num_heads, self.num_kv_heads, self.intermediate_size, self.scale,
            self.eps, rows, self.window if self.shared_window else 0)


def why_not(model: nn.Module, device: torch.device, tp_size: int) -> str | None:
    """Why the compiled stack cannot run `model` (a `LlamaForCausalLM`, its linear layers
    already packed, its fused ops set), or None when it can."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, LlamaModel):
        return "not a Llama-family decoder"
    unsupported = getattr(model, "compiled_stack_unsupported", None)
    if unsupported is not None:
        return unsupported
    dtype = decoder.norm.weight.dtype
    if device.type != "cpu" or dtype not in _DTYPES:
        return "it runs float32 or bfloat16 on a CPU"
    if tp_size != 1:
        return "tensor parallelism all-reduces between the layers' products"
    if ops.backend() != "cpu" or not ops.decoder_stack_available():
        return "the compiled CPU ops with AVX2 + FMA kernels are not loaded"
    if not all(m.fused for m in decoder.modules() if isinstance(m, FUSED_MODULES)):
        return "the fused elementwise ops are off"
    if any(isinstance(m, QuantLinear) for m in decoder.layers.modules()):
        why = why_not_quantized(decoder)
        if why is not None:
            return why
        return _why_not_layers(decoder)
    layers = linear_layers(decoder)
    panels = all(type(m.packed) is PanelWeight for m in layers)
    if not panels and not all(_on_onednn(m) for m in layers):
        return "the linear layers are neither all on the panels kernel nor all on oneDNN's packed weights"
    if panels and not all(layer.mlp.gate_up_proj.packed.silu_pairs for layer in decoder.layers):
        return "gate/up is not packed in pairs"
    return _why_not_layers(decoder)


def _why_not_layers(decoder: LlamaModel) -> str | None:
    """What the stack asks of every layer whatever its products' kernel: biases on q/k/v only,
    the same on every layer, one rotary table over whole heads, the same classes (per-head q/k
    norms on all or none, with the layers' epsilon), a head size the prefill kernel takes."""
    first = decoder.layers[0].self_attn
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return "a layer has biases besides q/k/v's"
        if (attn.qkv_proj.bias is None) != (first.qkv_proj.bias is None) or attn.rotary is not first.rotary:
            return "the layers differ in q/k/v biases or rotary tables"
        if type(attn) is not type(first) or type(mlp) is not type(decoder.layers[0].mlp):
            return "the layers differ in their attention or MLP classes"
        if hasattr(attn, "q_norm") and not attn.q_norm.eps == attn.k_norm.eps == layer.input_layernorm.eps:
            return "the per-head query / key norms' epsilon differs from the layers'"
        if attn.attn.logit_softcap is not None:
            return "a layer soft-caps its attention logits"
    if first.rotary.rotary_dim != first.head_size:
        return "partial rotary (part of each head rotated) is not in the compiled stack"
    if first.head_size % 16:
        return f"head size {first.head_size} is not a multiple of 16 (the prefill kernel's)"
    return None


def why_not_quantized(decoder: LlamaModel) -> str | None:
    """Why the stack cannot run a decoder whose layers hold quantized linear layers
    (QuantLinear), or None when it can (a QuantEmbedding runs before the stack: no matter).

    decoder_stack.cpp's quantized mode takes every product as quant_pack's uint8 tensor (the
    weights' dtype tells the mode), gate/up through quant_silu_mul."""
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, QuantLinear) for m in products):
            return "some of the linear layers are quantized, others dense"
        if not mlp.gate_up_proj.feeds_silu_mul:
            return "the quantized gate/up does not feed SiLU x up in one product"
    if not ops.quant_available():
        return "the compiled quantized kernels are not loaded"
    return None


def use_compiled_stack(model: nn.Module, device: torch.device, tp_size: int, enabled: bool = True) -> str | None:
    """Give `model`'s decoder the compiled stack where it applies (`enabled`), or take it away;
    returns why it does not run (None: it does)."""
    reason = why_not(model, device, tp_size) if enabled else "turned off"
    if isinstance(getattr(model, "model", None), LlamaModel):
        model.model.compiled_stack = CompiledDecoderStack.build(model.model) if reason is None else None
    return reason
