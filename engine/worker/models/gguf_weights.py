"""A model of any served family built straight from a GGUF file, its weights kept as stored
(which tensor fills which layer: engine/worker/models/gguf_layout.py).

The model is built on the ``meta`` device (no memory), then each linear layer whose GGUF tensors
are all of a type the quantized kernels take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
becomes a `QuantLinear` over those tensors' blocks, copied once into the kernels' packing (merged
q/k/v and gate/up as row segments, each of its own type); the token table likewise
(`QuantEmbedding`, and a tied LM head multiplies the same packed tensor). Only what is left (norms, layers of other
types) is allocated, in the model's dtype, and filled with dequantized values
(`gguf.quants.dequantize`). Each tensor's pages of the file are dropped from memory once copied,
so loading holds the packed weights and one tensor of the file at a time.

With ``--quantization q8_0|q4_0|q4_k`` the decoder's linear layers not kept as stored are
quantized to that type from their dequantized values; with the kernels unavailable (not a CPU,
or not built here) every tensor is dequantized.

NOTE: llama.cpp's converter permutes the rows of a Llama Q and K weight (and bias) so that its
rotary pairs adjacent values within a head; ours, HF's rotate_half, pairs the head's two halves.
Undoing it is a row permutation, and a quantized row is whole blocks, so the rows' bytes are
shuffled as stored: the dequantized weights equal transformers' (which un-permutes the same way).

On a pipeline stage the model holds its stage's modules only (engine/worker/stage_layout.py), and
only their tensors are read: the other stages' layers, and the embedding, the LM head or the final
norm where another stage holds them, are never touched in the file.

A mixture of experts' expert tensors are 3-D ([experts, rows, K]); each expert's slice becomes
that expert's own QuantLinear (gate/up merged, down), so moe.SparseMoE runs each expert's
quantized product on the rows routed to it. The router (`ffn_gate_inp`, F32 as the converter
writes it) is always dense.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter

import numpy as np
import torch
from torch import nn

from engine.worker.models.gguf_file import GGUFFile
from engine.worker.models.gguf_layout import TensorGroup, linear_groups, norm_tensors, split_experts
from engine.worker.models.layers import RotaryEmbedding
from engine.worker.models.registry import model_class
from engine.worker.models.quant_linear import QUANTIZE_TYPES, QuantEmbedding, QuantLinear, QuantLMHead
from engine.worker.models.quant_ops import qops
from engine.worker.models.quantize import log_fallbacks, quantize_to
from engine.worker.stage_layout import MissingLayer, StageLayout

logger = logging.getLogger(__name__)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes convert_hf_to_gguf.py's `permute` of a Q or K weight of `heads`
    heads: row (h, j, i) of the result is row (h, i, j) of the file's, i < head_dim / 2, j < 2."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def kernels_unavailable(device: torch.device) -> str | None:
    """Why weights cannot stay quantized on `device` (None: they can)."""
    if device.type != "cpu":
        return "the quantized kernels run on CPUs only"
    if not qops.quant_available():
        return "the quantized kernels are not built for this CPU"
    return None


def build_model(model_config, device: torch.device) -> nn.Module:
    """`model_config`'s model (path: a .gguf file), its weights loaded; the file is closed."""
    t0 = time.perf_counter()
    f = GGUFFile.open(model_config.path)
    try:
        model = _build(f, model_config, device)
    finally:
        f.close()
    logger.info("loaded %s in %.1f s", f.path.name, time.perf_counter() - t0)
    return model


def _build(f: GGUFFile, mc, device: torch.device) -> nn.Module:
    hf, dtype = mc.hf_config, mc.dtype
    why_dense = kernels_unavailable(device) if mc.quantization != "none" else "--quantization none"
    keep = why_dense is None
    requantize = mc.quantization if keep and mc.quantization in QUANTIZE_TYPES else None
    model = _skeleton(hf, mc.max_model_len, device)
    stage = StageLayout.of_this_rank(hf.num_hidden_layers)
    kept, dense, fallbacks = Counter(), Counter(), Counter()
    dense_groups = []
    for g in linear_groups(hf, f.arch, split_experts(f.tensors)):
        if not stage.holds(g.module):  # another pipeline stage's layer
            continue
        types = [f.tensors[n].qtype for n in g.tensors]
        meta = model.get_submodule(g.module)
        if g.dense_only:
            dense_groups.append(g)
            continue
        if keep and all(t in qops.QUANT_TYPES for t in types):
            packed = qops.quant_pack([(_bytes(f, n, h, g.expert), t)
                                      for n, h, t in zip(g.tensors, g.permuted_heads, types)])
            kept.update(types)
        elif requantize:
            packed = quantize_to(_dense(f, g.tensors, g.permuted_heads, g.expert), requantize, fallbacks)
            dense.update(types)
        else:
            dense_groups.append(g)
            dense.update(types)
            continue
        bias = _dense(f, g.biases, g.permuted_heads).to(dtype) if g.biases else None
        _replace(model, g.module, QuantLinear(packed, bias, getattr(meta, "out_sizes", None),
                                              getattr(meta, "feeds_silu_mul", False)))
        _release(f, g)
    tied = hf.tie_word_embeddings
    if stage.first:  # NOTE: the embedding and the LM head are the first stage's
        embed = f.tensors["token_embd.weight"]
        if keep and embed.qtype in qops.QUANT_TYPES:
            packed = qops.quant_pack([(_bytes(f, embed.name, None), embed.qtype)])
            model.model.embed_tokens = QuantEmbedding(packed, dtype)
            if tied:
                model.lm_head = QuantLMHead(packed, hf.vocab_size)
            kept[embed.qtype] += 1
            f.release(embed.name)
        else:
            dense[embed.qtype] += 1
        output = None if tied else f.tensors["output.weight"]
        if output is not None and keep and output.qtype in qops.QUANT_TYPES:
            packed = qops.quant_pack([(_bytes(f, output.name, None), output.qtype)])
            model.lm_head = QuantLMHead(packed, hf.vocab_size)
            kept[output.qtype] += 1
            f.release(output.name)
        elif output is not None:
            dense[output.qtype] += 1

    if requantize:
        log_fallbacks(requantize, fallbacks)
    model.to(dtype=dtype)  # NOTE: after the swap, so only what stays dense is converted (and touched)
    _materialize(model, device)
    with torch.no_grad():
        norms = {g: p for g, p in norm_tensors(hf, f.arch).items() if stage.holds(p)}
        _fill_dense(f, model, dense_groups, norms, tied)
        _reset_rotary(model, hf, mc.max_model_len)
    if kept:
        logger.info("%s: weights kept as stored: %s", f.path.name, _counts(kept))
    if dense:
        # NOTE: one line naming the types that made tensors dense (a merged layer goes dense whole)
        foreign = sorted(t.upper() for t in dense if t not in qops.QUANT_TYPES)
        why = why_dense or f"no quantized kernel for {', '.join(foreign)}"
        into = f"quantized to {requantize}" if requantize else f"served dense in {str(dtype).removeprefix('torch.')}"
        logger.info("%s: %s: %d tensors (%s) %s", f.path.name, why, sum(dense.values()), _counts(dense), into)
    return model


def _counts(c: Counter) -> str:
    return ", ".join(f"{t.upper()} x {n}" for t, n in c.most_common())


def _release(f: GGUFFile, g: TensorGroup) -> None:
    """Drop the group's tensors' pages once read: an expert's 3-D tensors after the last expert's."""
    for n in g.tensors + g.biases:
        if g.expert is None or g.expert == f.tensors[n].shape[0] - 1:
            f.release(n)


def _bytes(f: GGUFFile, name: str, heads: int | None, expert: int | None = None) -> torch.Tensor:
    """A tensor's blocks as stored, uint8 [rows, row_bytes], its rows un-permuted if `heads`
    (with `expert`: that expert's slice of a 3-D tensor)."""
    raw = np.asarray(f.raw(name, expert))
    if heads:
        return torch.from_numpy(raw[unpermute_rows(raw.shape[0], heads)])
    with warnings.catch_warnings():
        # NOTE: a read-only view of the mapped file, which the packing only reads and copies.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _dense(f: GGUFFile, names: tuple[str, ...], heads: tuple[int | None, ...], expert: int | None = None
           ) -> torch.Tensor:
    """The tensors (or an expert's slices) dequantized to float32 and concatenated along rows
    (q/k un-permuted)."""
    parts = []
    for name, h in zip(names, heads):
        t = f.dense(name, expert)
        parts.append(t[torch.from_numpy(unpermute_rows(t.shape[0], h))] if h else t)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _skeleton(hf, max_model_len: int, device: torch.device) -> nn.Module:
    """The model with its weights not yet read: on the CPU, built for real with uninitialised
    (`torch.empty`, so never-touched) weights, which the kept layers then replace; elsewhere on
    the meta device, materialized on `device` after the swap.

    NOTE: not the meta device on the CPU: the first tensor made under `torch.device("meta")` in
    a process imports torch's Python meta kernels and with them torch._dynamo, sympy and
    torch.distributed.tensor, ~80 MB of resident memory for the life of the server."""
    if device.type == "cpu":
        return model_class(hf)(hf, max_model_len)
    with torch.device("meta"):
        return model_class(hf)(hf, max_model_len)


def _replace(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) every parameter and buffer still on the meta device, keeping
    shared ones (a tied LM head) shared; the packed weights are left as they are."""
    made: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table, wrap in ((m._parameters, True), (m._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=device)
                    if wrap:
                        new = nn.Parameter(new, requires_grad=False)
                        new.__dict__.update(t.__dict__)  # weight_loader
                    made[id(t)] = new
                table[name] = made[id(t)]


def _fill_dense(f: GGUFFile, model: nn.Module, groups: list[TensorGroup], norms: dict[str, str], tied: bool) -> None:
    for g in groups:
        module = model.get_submodule(g.module)
        module.weight.copy_(_dense(f, g.tensors, g.permuted_heads, g.expert))
        if g.biases:
            module.bias.copy_(_dense(f, g.biases, g.permuted_heads))
        _release(f, g)
    params = dict(model.named_parameters(remove_duplicate=False))
    for gguf_name, name in norms.items():
        params[name].copy_(f.dense(gguf_name))
    embed = model.model.embed_tokens
    if isinstance(embed, MissingLayer):  # on another pipeline stage, with the LM head
        return
    if not isinstance(embed, QuantEmbedding):
        embed.weight.copy_(f.dense("token_embd.weight"))
        f.release("token_embd.weight")
    if not tied and not isinstance(model.lm_head, QuantLMHead):
        model.lm_head.weight.copy_(f.dense("output.weight"))
        f.release("output.weight")


def _reset_rotary(model: nn.Module, hf, max_positions: int) -> None:
    """The rotary tables, which a model built on the meta device has not computed (and which
    `model.to(dtype)` rounded): one shared table, or one per layer type (Gemma 3's)."""
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fresh = model.model.make_rotary(hf, head_size, max_positions)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer, MissingLayer):  # another pipeline stage's
            continue
        new = fresh[hf.layer_types[i]] if isinstance(fresh, dict) else fresh
        old = layer.self_attn.rotary
        if not isinstance(old, RotaryEmbedding):  # a layer without rotary (SmolLM3's NoPE)
            continue
        old.cos.copy_(new.cos)
        old.sin.copy_(new.sin)
