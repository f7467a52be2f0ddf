"""TEMPORARY pure-torch stand-in for the quantized-weight kernels of ``cuda_ext.ops`` (branch
quant-kernels). DELETE THIS FILE once that branch is merged: ``engine/models/quant_ops.py`` then
finds the functions in ``cuda_ext.ops`` and never imports this module.

It implements the same interface, slowly, so that the loader and the model can be developed and
tested before the C++ kernels exist:

* ``quant_pack(parts)``: a self-describing uint8 tensor, a small header (int64 words: magic, N,
  K, number of segments, then per segment its type index in QUANT_TYPES and its rows) followed by
  every segment's GGUF blocks exactly as given;
* ``quant_matmul`` dequantizes the weight (torch ports of ``gguf.quants``' dequantizers, equal to
  them bit for bit) and, like llama.cpp's CPU kernels, multiplies activations rounded to 8 bits
  (per 32 values for Q4_0 / Q4_1 / Q8_0, per 256 for the K-quants, scale = max |x| / 127). The
  compiled kernels' activation rounding may differ in detail: the quality bounds in
  tests/engine/test_gguf_quant.py are to be re-measured on them. It sums in float64 and rounds to float32, so a row's result does not depend on the other rows
  of the batch (as a kernel that computes each row the same way): float32 GEMMs sum in an order
  that depends on the row count, and 8-bit activations turn those ulps into whole rounding steps
  (greedy output changed under batching in tests/server/test_openai_server.py).
  NOTE: for the tests' speed it keeps each weight's dequantized (float64) copy after its first
  product (dropped with the packed tensor): memory use past loading is NOT the kernels'.
* ``quantize_weight`` uses ``gguf.quants.quantize`` (q8_0, q4_0, q4_1 only: gguf-py cannot
  quantize the K-quants).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
# (values per block, bytes per block), as ggml's GGML_QUANT_SIZES
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176),
         "q6_k": (256, 210)}
_MAGIC = 0x5154_5341_4E44  # "STANDQ"-ish: marks a stand-in packed tensor


def quant_available() -> bool:
    return True


def quant_pack(parts: list[tuple[Tensor, str]]) -> Tensor:
    """Row segments [rows, row_bytes] of one weight W [N, K] (GGUF blocks as stored) -> packed."""
    if not parts:
        raise ValueError("quant_pack needs at least one segment")
    k = None
    header = [_MAGIC, 0, 0, len(parts)]
    for raw, qtype in parts:
        if qtype not in QUANT_TYPES:
            raise ValueError(f"quant_pack: unsupported type {qtype!r}")
        if raw.dtype != torch.uint8 or raw.dim() != 2:
            raise ValueError("quant_pack: segments are uint8 [rows, row_bytes]")
        per, size = BLOCK[qtype]
        if raw.shape[1] % size:
            raise ValueError(f"quant_pack: {raw.shape[1]} bytes per row is not a whole number of {qtype} blocks")
        seg_k = raw.shape[1] // size * per
        if k is not None and seg_k != k:
            raise ValueError(f"quant_pack: segments disagree on K ({k} and {seg_k})")
        k = seg_k
        header += [QUANT_TYPES.index(qtype), raw.shape[0]]
    header[1], header[2] = sum(raw.shape[0] for raw, _ in parts), k
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head] + [raw.contiguous().reshape(-1) for raw, _ in parts])


def quant_info(packed: Tensor) -> tuple[int, int, list[tuple[str, int]]]:
    words = packed[:32].view(torch.int64).tolist()
    if words[0] != _MAGIC:
        raise ValueError("not a packed quantized weight")
    n, k, count = words[1:4]
    segs = packed[32 : 32 + 16 * count].view(torch.int64).tolist()
    return n, k, [(QUANT_TYPES[segs[2 * i]], segs[2 * i + 1]) for i in range(count)]


def _segments(packed: Tensor):
    """(qtype, raw [rows, row_bytes]) per segment, views of `packed`."""
    _, k, segs = quant_info(packed)
    offset = 32 + 16 * len(segs)
    out = []
    for qtype, rows in segs:
        per, size = BLOCK[qtype]
        row_bytes = k // per * size
        out.append((qtype, packed[offset : offset + rows * row_bytes].view(rows, row_bytes)))
        offset += rows * row_bytes
    return out


def quant_dequantize(packed: Tensor) -> Tensor:
    return torch.cat([dequantize_raw(raw, qtype) for qtype, raw in _segments(packed)])


_dequantized: dict[int, tuple[weakref.ref, list[tuple[str, Tensor]]]] = {}


def _weights(packed: Tensor) -> list[tuple[str, Tensor]]:
    """(qtype, float64 rows) per segment, cached while `packed` lives."""
    hit = _dequantized.get(id(packed))
    if hit is not None and hit[0]() is packed:
        return hit[1]
    segs = [(qtype, dequantize_raw(raw, qtype).double()) for qtype, raw in _segments(packed)]
    key = id(packed)
    _dequantized[key] = (weakref.ref(packed, lambda _: _dequantized.pop(key, None)), segs)
    return segs


def quant_matmul(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    outs = []
    xf = x.float()
    for qtype, w in _weights(packed):
        outs.append(F.linear(_round_activations(xf, 256 if qtype.endswith("_k") else 32).double(), w).float())
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quant_silu_mul(x: Tensor, packed_gate_up: Tensor) -> Tensor:
    gate, up = quant_matmul(x.float(), packed_gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def quant_embedding(packed: Tensor, ids: Tensor) -> Tensor:
    ids = ids.reshape(-1).long()
    out = torch.empty(ids.numel(), quant_info(packed)[1], dtype=torch.float32)
    start = 0
    for qtype, raw in _segments(packed):
        mine = (ids >= start) & (ids < start + raw.shape[0])
        if mine.any():
            out[mine] = dequantize_raw(raw[ids[mine] - start], qtype)
        start += raw.shape[0]
    return out


def quantize_weight(w: Tensor, qtype: str) -> Tensor:
    import gguf

    if qtype not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"the stand-in kernels cannot quantize to {qtype} (gguf-py has no K-quant quantizer)")
    raw = gguf.quants.quantize(w.detach().float().cpu().numpy(), gguf.GGMLQuantizationType[qtype.upper()])
    return quant_pack([(torch.from_numpy(np.ascontiguousarray(raw)), qtype)])


def _round_activations(x: Tensor, block: int) -> Tensor:
    """x with each `block` consecutive values rounded to 8 bits (scale max |x| / 127)."""
    k = x.shape[-1]
    if k % block:
        return x
    blocks = x.reshape(*x.shape[:-1], k // block, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks))
    return (q * scale).reshape(x.shape)


# ------------------------------------------------------------- dequantizers (gguf.quants in torch)


def dequantize_raw(raw: Tensor, qtype: str) -> Tensor:
    """float32 [rows, K] of GGUF blocks [rows, row_bytes]; equal to gguf.quants.dequantize."""
    per, size = BLOCK[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, size)
    out = _DEQUANT[qtype](blocks)
    return out.reshape(rows, -1)


def _f16(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, half: int) -> Tensor:
    """[n, groups * half] bytes -> [n, groups, 2 * half]: low nibbles, then high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, half)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(n, -1, 2 * half)


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, -1, 1)
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = _nibbles(qs, 32).reshape(n, -1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    hi = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x01).reshape(n, -1, 32)
    q = (ql | (hi << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    d = (_f16(d) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    lo = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    hi = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, -1).float()).reshape(n, 256)


_DEQUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}
