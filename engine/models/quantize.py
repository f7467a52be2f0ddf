"""`quantize_linear_layers`: an fp checkpoint's decoder linear layers quantized on load
(``--quantization q8_0|q4_0|q4_k``), each dense `ColumnParallelLinear` / `RowParallelLinear`
replaced by a `QuantLinear` (engine/models/quant_linear.py) of its weight.

NOTE: apart from quant_linear.py because it needs the dense layers (layers.py), which import the
linear kernels, which import quant_linear.py to pass its layers by: kept there, it closed an
import circle.
"""

from __future__ import annotations

from torch import nn

from engine.models.layers import ColumnParallelLinear, RowParallelLinear
from engine.models.quant_linear import QuantLinear
from engine.models.quant_ops import qops


def quantize_linear_layers(model: nn.Module, qtype: str) -> int:
    """Replace the decoder layers' dense linear layers (q/k/v, o, gate/up, down) by QuantLinear
    layers of their weights quantized to `qtype` (``--quantization`` on an fp checkpoint); the
    embedding and LM head stay dense. Returns how many were replaced."""
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if decoder is None:
        raise ValueError("--quantization needs a Llama-family decoder")
    count = 0
    for parent in decoder.modules():
        for name, child in list(parent.named_children()):
            if not isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                continue
            bias = None if child.bias is None else child.bias.detach().clone()
            layer = QuantLinear(qops.quantize_weight(child.weight.detach().float(), qtype), bias,
                                getattr(child, "out_sizes", None), getattr(child, "feeds_silu_mul", False))
            setattr(parent, name, layer)
            count += 1
    return count
