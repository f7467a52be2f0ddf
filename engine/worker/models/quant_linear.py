"""Layers over weights kept quantized, as GGUF stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K): `QuantLinear` (a linear layer), `QuantEmbedding` (the token table) and `QuantLMHead`
(logits, over the token table when tied). Each holds one packed uint8 tensor (`qweight`, a
buffer: it is never trained, and `model.to(dtype)` leaves it alone) and calls the quantized kernels
(engine/worker/models/quant_ops.py); there is no dense `weight`, so the dense linear-kernel machinery
(engine/worker/models/linear_kernel.py) passes these layers by.

Their products are not a dense layer's floats: the kernels multiply activations rounded to 8
bits, as llama.cpp's do, so outputs drift from the dequantized model's within the quantization's
error (tests/engine/test_gguf_quant.py bounds it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.worker.models.quant_ops import qops, row_bytes

# what --quantization may ask an fp checkpoint's linear layers to become
QUANTIZE_TYPES = ("q8_0", "q5_1", "q5_0", "q4_0", "q4_k")


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) over a packed W [out_features, in_features]. Stands in for
    ColumnParallelLinear and its kin at tensor-parallel size 1; `out_sizes` are the row segments
    of a merged layer (q/k/v, gate/up), and with `feeds_silu_mul` (gate/up) `silu_mul` gives
    silu(x W_gate^T) * (x W_up^T) in one kernel call."""

    def __init__(self, packed: Tensor, bias: Tensor | None = None, out_sizes: list[int] | None = None,
                 feeds_silu_mul: bool = False):
        super().__init__()
        n, k, segments = qops.quant_info(packed)
        self.out_features, self.in_features, self.segments = n, k, segments
        self.out_sizes = list(out_sizes) if out_sizes else [n]
        self.feeds_silu_mul = feeds_silu_mul and len(self.out_sizes) == 2 and bias is None
        self.register_buffer("qweight", packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp_size = 1

    def forward(self, x: Tensor) -> Tensor:
        return qops.quant_matmul(x, self.qweight, self.bias)

    def silu_mul(self, x: Tensor) -> Tensor | None:
        return qops.quant_silu_mul(x, self.qweight) if self.feeds_silu_mul else None

    def dequantized(self) -> Tensor:
        """W as float32 [out_features, in_features]."""
        return qops.quant_dequantize(self.qweight)

    def extra_repr(self) -> str:
        types = ", ".join(f"{t}: {rows}" for t, rows in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=({types})"


class QuantEmbedding(nn.Module):
    """The token table, packed; rows come out dequantized in `dtype` (the model's)."""

    def __init__(self, packed: Tensor, dtype: torch.dtype):
        super().__init__()
        n, k, self.segments = qops.quant_info(packed)
        self.vocab_size, self.dim, self.dtype = n, k, dtype
        self.register_buffer("qweight", packed)

    def forward(self, ids: Tensor) -> Tensor:
        return qops.quant_embedding(self.qweight, ids).to(self.dtype)


class QuantLMHead(nn.Module):
    """Logits over the vocabulary from a packed [vocab, hidden] table (the embedding's own
    tensor when tied)."""

    def __init__(self, packed: Tensor, vocab_size: int):
        super().__init__()
        _, _, self.segments = qops.quant_info(packed)
        self.vocab_size = vocab_size
        self.register_buffer("qweight", packed)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return qops.quant_matmul(hidden, self.qweight)[..., : self.vocab_size]


QUANT_MODULES = (QuantLinear, QuantEmbedding, QuantLMHead)


def weight_footprint(model: nn.Module) -> tuple[dict[str, int], int]:
    """(bytes of weights per storage type, e.g. {"q4_1": ..., "q8_0": ..., "float32": ...},
    number of parameters) of `model`'s parameters and packed weights, each tensor counted once
    (a tied LM head shares the embedding's)."""
    by_type: dict[str, int] = {}
    params = 0
    seen: set[int] = set()
    for m in model.modules():
        tensors = [(t, None) for t in m.parameters(recurse=False)]
        if isinstance(m, QUANT_MODULES):
            tensors.append((m.qweight, m))
        for t, owner in tensors:
            if t.data_ptr() in seen or t.numel() == 0:
                continue
            seen.add(t.data_ptr())
            if owner is None:
                kind = str(t.dtype).removeprefix("torch.")
                by_type[kind] = by_type.get(kind, 0) + t.numel() * t.element_size()
                params += t.numel()
                continue
            n, k, segments = qops.quant_info(t)
            params += n * k
            rest = t.numel()
            for qtype, rows in segments:
                size = rows * row_bytes(qtype, k)
                by_type[qtype] = by_type.get(qtype, 0) + size
                rest -= size
            by_type[segments[0][0]] += rest  # the packing's own header / padding
    return by_type, params


def describe_footprint(by_type: dict[str, int]) -> str:
    """'98.4 MB (q4_1 70.0 MB, q8_0 28.3 MB, float32 0.1 MB)'."""
    total = sum(by_type.values())
    parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    return f"{total / 1e6:.1f} MB ({parts})"
