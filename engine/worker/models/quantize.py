"""Weights quantized on load (``--quantization q8_0|q4_0|q4_k``): `quantize_to` one weight (with
the per-tensor fallback where its rows are not whole blocks), and `quantize_linear_layers`, an fp
checkpoint's decoder linear layers, each dense `ColumnParallelLinear` / `RowParallelLinear`
replaced by a `QuantLinear` (engine/worker/models/quant_linear.py) of its weight.

NOTE: apart from quant_linear.py because it needs the dense layers (layers.py), which import the
linear kernels, which import quant_linear.py to pass its layers by: kept there, it closed an
import circle.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from engine.worker.models.layers import ColumnParallelLinear, RowParallelLinear
from engine.worker.models.quant_linear import QuantLinear
from engine.worker.models.quant_ops import BLOCK, qops

logger = logging.getLogger(__name__)
# NOTE: llama-quantize's per-tensor fallbacks (Q4_K -> Q5_0), so that a q4_k model's bytes and
# rounding match its Q4_K_M file's where rows are not whole 256-value blocks (576, 896, 960 wide)
FALLBACK_TYPES = {"q4_k": "q5_0"}


def fallback_type(qtype: str) -> str:
    return FALLBACK_TYPES.get(qtype, "q8_0")


def quantize_to(w: torch.Tensor, qtype: str, fallbacks: Counter) -> torch.Tensor:
    """`w` [N, K] quantized to `qtype` and packed; where K is not whole blocks of that type (a
    K-quant's 256 values: the 135M default's 576-wide rows), to `fallback_type(qtype)` instead,
    counted in `fallbacks` by K."""
    k = w.shape[-1]
    if k % BLOCK[qtype][0]:
        fallbacks[k] += 1
        qtype = fallback_type(qtype)
    return qops.quantize_weight(w, qtype)


def log_fallbacks(qtype: str, fallbacks: Counter) -> None:
    if fallbacks:
        logger.info("%s needs rows of whole %d-value blocks: %d linear layers (rows of %s values) quantized to "
                    "%s instead", qtype, BLOCK[qtype][0], sum(fallbacks.values()),
                    ", ".join(str(k) for k in sorted(fallbacks)), fallback_type(qtype))


def quantize_linear_layers(model: nn.Module, qtype: str) -> int:
    """Replace the decoder layers' dense linear layers (q/k/v, o, gate/up, down) by QuantLinear
    layers of their weights quantized to `qtype` (``--quantization`` on an fp checkpoint); the
    embedding and LM head stay dense. Returns how many were replaced."""
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if decoder is None:
        raise ValueError("--quantization needs a Llama-family decoder")
    count, fallbacks = 0, Counter()
    for parent in decoder.modules():
        for name, child in list(parent.named_children()):
            if not isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                continue
            bias = None if child.bias is None else child.bias.detach().clone()
            layer = QuantLinear(quantize_to(child.weight.detach().float(), qtype, fallbacks), bias,
                                getattr(child, "out_sizes", None), getattr(child, "feeds_silu_mul", False))
            setattr(parent, name, layer)
            count += 1
    log_fallbacks(qtype, fallbacks)
    return count
