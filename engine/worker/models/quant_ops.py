"""The quantized-weight kernels the model layers call: ``cuda_ext.ops``'s quant_* functions
(compiled integer-dot-product kernels, csrc/cpu/quant_*.cpp; their pure-torch reference where the
library is not loaded), and the GGUF block geometry the loader needs.

Interface: ``QUANT_TYPES``, ``quant_available()``, ``quant_pack(parts)``, ``quant_info(packed)``,
``quant_matmul(x, packed, bias=None)``, ``quant_silu_mul(x, packed)``, ``quant_embedding(packed,
ids)``, ``quant_dequantize(packed)``, ``quantize_weight(w, qtype)``. A packed weight is a uint8
tensor holding one weight W [N, K] as row segments of GGUF blocks.
"""

from __future__ import annotations

from cuda_ext import ops as qops  # noqa: F401 (the layers' kernels)

# (values per block, bytes per block) of the types the kernels keep as stored
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
         "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}


def row_bytes(qtype: str, k: int) -> int:
    per, size = BLOCK[qtype]
    return k // per * size
