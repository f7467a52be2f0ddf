"""Where the quantized-weight kernels come from: ``cuda_ext.ops`` (the compiled kernels of branch
quant-kernels) when it has them, else the TEMPORARY pure-torch stand-in
(engine/models/_quant_standin.py, to be deleted with this fallback once that branch is merged).

Interface (both implement it): ``QUANT_TYPES``, ``quant_available()``, ``quant_pack(parts)``,
``quant_info(packed)``, ``quant_matmul(x, packed, bias=None)``, ``quant_silu_mul(x, packed)``,
``quant_embedding(packed, ids)``, ``quant_dequantize(packed)``, ``quantize_weight(w, qtype)``.
A packed weight is a uint8 tensor holding one weight W [N, K] as row segments of GGUF blocks.
"""

from __future__ import annotations

from cuda_ext import ops as _ops

if hasattr(_ops, "quant_matmul"):
    qops = _ops
else:  # NOTE: temporary, until the compiled kernels are merged
    from engine.models import _quant_standin as qops

# (values per block, bytes per block) of the types the kernels keep as stored
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176),
         "q6_k": (256, 210)}


def row_bytes(qtype: str, k: int) -> int:
    per, size = BLOCK[qtype]
    return k // per * size
