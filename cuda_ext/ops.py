"""The PagedAttention op set: the only module that touches ``torch.ops.paged_serve``.

Backend choice, made once per process on first use and logged:

* ``compiled`` kernels (``"cpu"``, or ``"cuda"`` where torch has CUDA and nvcc exists), built by
  :mod:`cuda_ext.build`; calls on CPU tensors run the C++ kernels, calls on CUDA tensors the
  CUDA kernels;
* ``reference`` (pure torch, :mod:`cuda_ext.reference`) when the build fails (with a warning) or
  when ``PAGED_SERVE_OPS=reference`` forces it. ``PAGED_SERVE_OPS=compiled`` makes a failed
  build an error instead of a fallback.

Shapes: caches ``[num_blocks, num_kv_heads, block_size, head_size]``; per-token K/V
``[num_tokens, num_kv_heads, head_size]``; queries ``[num_seqs, num_heads, head_size]``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cuda_ext import reference
from cuda_ext.reference import gather_cached_kv

logger = logging.getLogger(__name__)

__all__ = [
    "CopyBlocksTable",
    "backend",
    "check_device_errors",
    "compiled_library",
    "copy_blocks",
    "copy_blocks_table",
    "decoder_stack",
    "decoder_stack_available",
    "draw_tokens",
    "draw_tokens_compiled",
    "gather_cached_kv",
    "linear_pack",
    "linear_panels",
    "linear_panels_available",
    "linear_panels_silu_mul",
    "paged_attention",
    "prefill_attention",
    "prefill_attention_available",
    "QUANT_TYPES",
    "quant_available",
    "quant_dequantize",
    "quant_embedding",
    "quant_info",
    "quant_isa",
    "quant_matmul",
    "quant_pack",
    "quant_silu_mul",
    "quantize_ggml",
    "quantize_weight",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
]

# Head sizes the CUDA attention kernel is instantiated for; others run the reference on CUDA.
# The CPU kernel takes any head size.
CUDA_HEAD_SIZES = (64, 128)


@functools.cache
def backend() -> str:
    """``"cuda"`` or ``"cpu"`` (which compiled library is loaded), or ``"reference"``."""
    mode = os.environ.get("PAGED_SERVE_OPS", "auto").lower()
    if mode not in ("auto", "compiled", "reference"):
        raise ValueError(f"PAGED_SERVE_OPS must be auto, compiled or reference, not {mode!r}")
    if mode == "reference":
        logger.info("paged_serve ops: pure-torch reference (forced by PAGED_SERVE_OPS)")
        return "reference"
    from cuda_ext import build

    kind = "cuda" if torch.cuda.is_available() and _nvcc_available() else "cpu"
    try:
        build_dir = build.load(kind)
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: fall back
        if mode == "compiled":
            raise
        logger.warning(
            "paged_serve ops: could not build the compiled %s ops (%s: %s); using the slow "
            "pure-torch reference", kind.upper(), type(exc).__name__, str(exc)[-2000:],
        )
        return "reference"
    logger.info("paged_serve ops: compiled %s kernels loaded from %s", kind.upper(), build_dir)
    return kind


def compiled_library():
    """The ``torch.ops.paged_serve`` namespace (for ``torch.library.opcheck`` in the tests);
    raises if the compiled ops are not loaded."""
    if backend() == "reference":
        raise RuntimeError("the compiled paged_serve ops are not loaded (backend is 'reference')")
    return torch.ops.paged_serve


def _nvcc_available() -> bool:
    from cuda_ext import build

    return build.cuda_home() is not None


def _compiled_for(t: Tensor) -> bool:
    """Whether a call on tensors living where ``t`` lives runs a compiled kernel."""
    b = backend()
    return b == "cuda" or (b == "cpu" and t.device.type == "cpu")


def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write the new tokens' K/V into their cache slots, in place.

    ``slot_mapping[i] = block_id * block_size + offset`` for token ``i`` (int64); a negative
    slot skips the token (padding). A slot >= ``num_blocks * block_size`` is a RuntimeError
    (on CUDA with the mapping in device memory: the token is skipped, and the error raised at
    the next call or by :func:`check_device_errors`).
    """
    if _compiled_for(key_cache):
        torch.ops.paged_serve.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping.to(torch.int64)
        )
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Decode attention through the block tables, one query token per sequence; writes ``out``.

    ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32; ``context_lens``: ``[num_seqs]``
    int32, counting the cached tokens including the current one. ``max_context_len`` (a host
    int, at least the max of ``context_lens``, at most ``max_blocks_per_seq * block_size``)
    sizes the CUDA kernel's partitions. GQA: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. fp32/fp16/bf16, fp32 accumulation. ``window`` > 0: the
    query (position ``context_len - 1``) sees only the last ``window`` keys; ``softcap`` > 0: the
    scaled logits s become ``softcap * tanh(s / softcap)`` (engine/worker/window_attention.py's
    semantics, HF's). 0: none. The CUDA kernels compute neither: such calls run the reference there.

    Both compiled backends refuse the same calls (RuntimeError): bad shapes or dtypes, a cache
    with 0 blocks or KV heads, ``max_context_len`` past the table, and, for tables and lengths
    in CPU memory, a block id outside the pool or a context_len above ``max_context_len``. On
    CUDA, such entries in device memory are caught by the kernel and raised at the next call
    (or by :func:`check_device_errors`).
    """
    compiled = _compiled_for(query) and (
        query.device.type == "cpu" or (query.shape[-1] in CUDA_HEAD_SIZES and not window and not softcap)
    )
    if compiled:
        torch.ops.paged_serve.paged_attention(
            out, query, key_cache, value_cache,
            block_tables.to(torch.int32), context_lens.to(torch.int32),
            float(scale), int(max_context_len), int(window), float(softcap),
        )
    else:
        reference.paged_attention(
            out, query, key_cache, value_cache, block_tables, context_lens, scale,
            max_context_len, window, softcap,
        )


@functools.cache
def prefill_attention_available() -> bool:
    """Whether the CPU prefill attention kernel (csrc/cpu/prefill_attention.cpp: fp32 and bf16,
    AVX2 + FMA builds) is loaded."""
    return backend() in ("cpu", "cuda") and bool(torch.ops.paged_serve.prefill_attention_available())


def prefill_attention(out: Tensor, query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                      spans: Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """Causal attention of prompt chunks, all in one call, every key and value read through the
    chunk's block table (its cached prefix and its own tokens, already written by
    :func:`reshape_and_cache`). Writes ``out`` ``[tokens, heads, head]`` (CPU, fp32 or bf16: the
    dtype of ``query`` and the caches; bf16 is computed in fp32). ``spans`` ``[chunks, 3]``
    int32: each chunk's first row, tokens, and tokens cached before it (its first position);
    ``block_tables`` ``[chunks, width]`` int32. Matches SDPA per chunk (``is_causal`` over the
    whole context) up to summation order. ``window`` > 0: a query at position p sees only the keys
    at (p - window, p]; ``softcap`` > 0: the scaled logits s become ``softcap * tanh(s / softcap)``
    (engine/worker/window_attention.py's ``attend``). 0: none."""
    torch.ops.paged_serve.prefill_attention(out, query, key_cache, value_cache, block_tables, spans, scale,
                                            int(window), float(softcap))


def decoder_stack_available() -> bool:
    """Whether :func:`decoder_stack` runs here: the compiled CPU ops with their AVX2 + FMA
    kernels (the panel GEMM and the prefill attention it calls)."""
    return linear_panels_available() and prefill_attention_available()


def decoder_stack(x: Tensor, positions: Tensor, weights: Sequence[Tensor], qkv_biases: Sequence[Tensor],
                  qk_norms: Sequence[Tensor], final_norm: Tensor, cos: Tensor, sin: Tensor, key_caches: Sequence[Tensor],
                  value_caches: Sequence[Tensor], slot_mapping: Tensor, prefill_tables: Tensor | None,
                  prefill_spans: Tensor | None, num_prefill_tokens: int, decode_tables: Tensor | None,
                  decode_lens: Tensor | None, max_decode_len: int, num_heads: int, num_kv_heads: int,
                  intermediate_size: int, scale: float, eps: float, rows: Tensor | None, window: int = 0) -> Tensor:
    """A Llama-family model's decoder layers and final RMSNorm over one step's tokens, in one
    call (csrc/cpu/decoder_stack.cpp): the kernels of this module, in the order and on the
    tensors engine/worker/models/llama.py uses with the fused ops and the panels kernel, so the same
    floats, without the host work between them. ``x``: the embeddings ``[tokens, hidden]`` fp32
    (overwritten); ``weights``: per layer its input norm, qkv panels, o panels, post-attention
    norm, gate/up panels in pairs (:func:`linear_panels_silu_mul`), down panels; ``qkv_biases``:
    none or one per layer; ``qk_norms``: none, or per layer the query and the key norm applied to
    each head before the rotary (Qwen3's). The products' weights may instead all be oneDNN's packed tensors, or
    all :func:`quant_pack`'s uint8 tensors (the dtype tells the stack: :func:`quant_matmul`, and
    gate/up a packed ``[gate | up]`` through :func:`quant_silu_mul`; x fp32 or bf16). Attention
    arguments as :func:`prefill_attention` (the first ``num_prefill_tokens`` rows) and
    :func:`paged_attention` (the others), ``window`` every layer's sliding window (0: none). Returns the normed
    hidden states of ``rows`` (int64 token indices; None: every token), ``[rows, hidden]``."""
    return torch.ops.paged_serve.decoder_stack(
        x, positions, list(weights), list(qkv_biases), list(qk_norms), final_norm, cos, sin, list(key_caches), list(value_caches),
        slot_mapping, prefill_tables, prefill_spans, num_prefill_tokens, decode_tables, decode_lens, max_decode_len,
        num_heads, num_kv_heads, intermediate_size, scale, eps, rows, int(window))


def draw_tokens_compiled(logits: Tensor) -> bool:
    """Whether :func:`draw_tokens` runs the compiled kernel for these logits (CPU ones only)."""
    return logits.device.type == "cpu" and _compiled_for(logits)


def draw_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
    """One token per row of ``logits`` (``[rows, vocab]``; ``temperature``, ``top_p``, ``u``:
    float32 ``[rows]``, temperature > 0 and finite, 0 <= u < 1): softmax at the temperature, the
    draw at ``u``, top-p's acceptance test; -1 where the draw is rejected or the row has no
    finite logit. Exactly :func:`cuda_ext.reference.draw_tokens`."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if draw_tokens_compiled(logits):
        logits = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.float().contiguous()
        torch.ops.paged_serve.draw_tokens(logits, temperature.float().contiguous(), top_p.float().contiguous(),
                                          u.float().contiguous(), tokens)
    else:
        reference.draw_tokens(logits, temperature, top_p, u, tokens)
    return tokens


def score_tokens(logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of ``logits`` (``[rows, vocab]``; ``targets`` int64 ``[rows]``): the target's raw
    logprob (float32) and rank (int32: 1 + the logits strictly above it), and the row's ``k``
    best ids (int64 ``[rows, k]``, largest first, ties by lower id) with their logprobs (float32
    ``[rows, k]``). A row of CPU logits holding NaN or +inf gets rank 0 from the compiled
    kernel: the caller scores it with :func:`cuda_ext.reference.score_tokens`, whose results the
    kernel's equal to rounding on every other row."""
    rows = logits.shape[0]
    dev = logits.device
    if rows and draw_tokens_compiled(logits):
        logits = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.float().contiguous()
        out = (torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int32),
               torch.empty(rows, k, dtype=torch.int64), torch.empty(rows, k, dtype=torch.float32))
        torch.ops.paged_serve.score_tokens(logits, targets.to(torch.int64).contiguous(), k, *out)
        return out
    return reference.score_tokens(logits.to(dev), targets, k)


@functools.cache
def linear_panels_available() -> bool:
    """Whether the CPU fp32 panel GEMM (csrc/cpu/linear.cpp: AVX2 + FMA builds) is loaded."""
    return backend() in ("cpu", "cuda") and bool(torch.ops.paged_serve.linear_panels_available())


def linear_pack(weight: Tensor) -> Tensor:
    """`weight` ([out_features, in_features] fp32, CPU) packed for :func:`linear_panels`:
    ``[ceil(out / 16), in, 16]``, panels of 16 output columns, zero-padded."""
    return torch.ops.paged_serve.linear_pack(weight)


def linear_panels(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias) for x ``[..., in_features]`` fp32 on the CPU and W packed by
    :func:`linear_pack`; the same product as ``F.linear(x, W, bias)`` up to summation order."""
    y = torch.ops.paged_serve.linear_panels(_rows(x), packed, out_features)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_features)


def linear_panels_silu_mul(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """``silu(x G^T) * (x U^T)`` for x ``[..., in_features]`` fp32 on the CPU, G and U (each
    ``[out_features, in_features]``) packed by :func:`linear_pack` as one weight whose 16-row
    groups alternate: G's rows 0-15, U's rows 0-15, G's 16-31, ... (each half zero-padded to a
    multiple of 16 rows). The same floats as :func:`linear_panels` over ``[G | U]`` followed by
    :func:`silu_and_mul`, without storing the two products."""
    y = torch.ops.paged_serve.linear_panels_silu_mul(_rows(x), packed, out_features)
    return y.view(*x.shape[:-1], out_features)


# GGUF-quantized weights kept as stored (csrc/cpu/quant_*.cpp; format: csrc/cpu/quant_format.h).
QUANT_TYPES = reference.QUANT_TYPES


@functools.cache
def quant_available() -> bool:
    """Whether the compiled quantized ops are loaded (every CPU build has them: AVX-512 VNNI,
    AVX2 or portable loops, see :func:`quant_isa`); otherwise the quant_* functions run the
    pure-torch reference, its packed tensors readable only by itself."""
    return backend() in ("cpu", "cuda")


def quant_isa() -> str:
    """The quantized kernels' instruction set: ``avx512_vnni``, ``avx_vnni``, ``avx2``,
    ``portable`` or ``reference``."""
    return str(torch.ops.paged_serve.quant_isa()) if quant_available() else "reference"


def quant_pack(parts: Sequence[tuple[Tensor, str]]) -> Tensor:
    """One self-describing packed uint8 tensor of a weight W [N, K] given as row segments
    ``(data, qtype)``: data uint8 ``[rows, row_bytes]`` holding GGUF blocks as stored (ggml's
    layout), qtype one of :data:`QUANT_TYPES`; every part of the same K. The parts may be
    dropped afterwards. A bad part is a ValueError (type) or RuntimeError naming it."""
    for _, qtype in parts:
        reference.quant_block(qtype)  # ValueError for a type not served
    if not quant_available():
        return reference.quant_pack(parts)
    return torch.ops.paged_serve.quant_pack([p for p, _ in parts], [reference.GGML_TYPE_IDS[q] for _, q in parts])


def quant_info(packed: Tensor) -> tuple[int, int, list[tuple[str, int]]]:
    """(N, K, [(qtype, rows) per segment]) of a packed weight (ValueError for anything else)."""
    return reference.quant_info(packed)


def quant_matmul(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias) for x ``[..., K]`` float32 or bfloat16 and W packed by :func:`quant_pack`;
    ``[..., N]`` in x's dtype. The activations are quantized per block to int8 as llama.cpp does
    (q8_0 for the legacy types' segments, q8_K for the K types), once per call; integer dot
    products, fp32 accumulation. Equals :func:`cuda_ext.reference.quant_matmul_ggml` to fp32
    summation order."""
    if quant_available():
        y = torch.ops.paged_serve.quant_matmul(_rows(x), packed, bias)
    else:
        y = reference.quant_matmul(x.reshape(-1, x.shape[-1]), packed, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def quant_silu_mul(x: Tensor, packed_gate_up: Tensor) -> Tensor:
    """``silu(x G^T) * (x U^T)`` for the MLP's merged gate/up weight packed by
    :func:`quant_pack` (N = 2 I, gate rows first): ``[..., I]`` in x's dtype, from the fp32
    products (rounded once to x's dtype)."""
    if quant_available():
        y = torch.ops.paged_serve.quant_silu_mul(_rows(x), packed_gate_up)
    else:
        y = reference.quant_silu_mul(x.reshape(-1, x.shape[-1]), packed_gate_up)
    return y.view(*x.shape[:-1], y.shape[-1])


def quant_embedding(packed: Tensor, ids: Tensor) -> Tensor:
    """float32 ``[len(ids), K]``: rows ``ids`` of a packed weight dequantized (token embeddings,
    and a tied LM head shares the packed weight)."""
    ids = ids.reshape(-1).to(torch.int64)
    if quant_available():
        return torch.ops.paged_serve.quant_embedding(packed, ids)
    return reference.quant_embedding(packed, ids)


def quant_dequantize(packed: Tensor) -> Tensor:
    """float32 ``[N, K]``: the whole packed weight, the same floats as gguf.quants.dequantize."""
    if quant_available():
        return torch.ops.paged_serve.quant_dequantize(packed)
    return reference.quant_dequantize(packed)


def quantize_weight(w: Tensor, qtype: str) -> Tensor:
    """A float weight ``[N, K]`` quantized to `qtype` and packed (for fp checkpoints served with
    ``--quantization``). The legacy types (q8_0 / q4_0 / q4_1 / q5_0 / q5_1) are ggml's reference
    quantizers, byte for byte gguf.quants.quantize's; the K types a least-squares fit per sub-block
    (csrc/cpu/quant_quantize.cpp)."""
    reference.quant_block(qtype)
    if not quant_available():
        return reference.quant_pack([(reference.quantize_ggml(w, qtype), qtype)])
    blocks = torch.ops.paged_serve.quant_quantize(w.detach(), reference.GGML_TYPE_IDS[qtype])
    return quant_pack([(blocks, qtype)])


def quantize_ggml(w: Tensor, qtype: str) -> Tensor:
    """A float weight ``[N, K]`` as ggml blocks ``[N, row_bytes]`` (what a GGUF file stores), by
    the quantizers of :func:`quantize_weight`."""
    reference.quant_block(qtype)
    if not quant_available():
        return reference.quantize_ggml(w, qtype)
    return torch.ops.paged_serve.quant_quantize(w.detach(), reference.GGML_TYPE_IDS[qtype])


def _rows(x: Tensor) -> Tensor:
    """x ``[..., in_features]`` as the 2-D rows the panel kernels take (last dim contiguous)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_here(compiled: bool, *tensors: Tensor) -> bool:
    """Whether the model's elementwise ops run compiled for these tensors: asked for, CPU tensors
    of a model dtype with a contiguous last dim, and the CPU kernels loaded."""
    t = tensors[0]
    return (compiled and t.device.type == "cpu" and t.dtype in _MODEL_DTYPES
            and all(x.stride(-1) == 1 and x.dtype == t.dtype for x in tensors) and backend() == "cpu")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
             compiled: bool = True) -> tuple[Tensor, Tensor]:
    """(weight * RMS-normalised (x + residual), x + residual) for x [rows, dim], as
    :func:`cuda_ext.reference.rms_norm`. With `residual`, the compiled path writes the sum into
    `residual` and the output into `x` (both must be the caller's to overwrite), in one pass."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not (_fused_here(compiled, *tensors) and x.dim() == 2 and weight.is_contiguous()
            and (residual is None or residual.shape == x.shape)):
        return reference.rms_norm(x, weight, eps, residual)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops.paged_serve.rms_norm(out, x, weight, float(eps))
        return out, x
    torch.ops.paged_serve.fused_add_rms_norm(x, residual, weight, float(eps))
    return x, residual


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor,
                     compiled: bool = True) -> None:
    """Rotate ``query`` [T, heads, d] and ``key`` [T, kv_heads, d] in place (views of one qkv
    tensor will do) by rows ``positions`` of ``cos`` / ``sin`` [max_positions, d] (float32 or
    the query's dtype), as
    :func:`cuda_ext.reference.rotary_embedding`. A position outside the tables is a
    RuntimeError on the compiled path (an IndexError in torch)."""
    if (_fused_here(compiled, query, key) and query.dim() == 3 and cos.device.type == "cpu"
            and cos.dtype in (torch.float32, query.dtype) and cos.is_contiguous() and sin.is_contiguous()):
        torch.ops.paged_serve.rotary_embedding(positions.to(torch.int64), query, key, cos, sin)
    else:
        reference.rotary_embedding(positions, query, key, cos, sin)


def silu_and_mul(x: Tensor, compiled: bool = True) -> Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [rows, 2d], as :func:`cuda_ext.reference.silu_and_mul`."""
    if not (_fused_here(compiled, x) and x.dim() == 2):
        return reference.silu_and_mul(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    torch.ops.paged_serve.silu_and_mul(out, x)
    return out


@dataclass(frozen=True)
class CopyBlocksTable:
    """The caches' data pointers for the CUDA copy_blocks kernel, built once and kept on the
    caches' device (see :func:`copy_blocks_table`), so that a copy-on-write step uploads nothing
    but its block mapping. ``data_ptrs`` is the host copy, checked against the caches at every
    call; ``device_ptrs`` is None where the kernel needs no table (CPU caches, the reference)."""

    data_ptrs: tuple[int, ...]
    device_ptrs: Tensor | None


def copy_blocks_table(key_caches: Sequence[Tensor], value_caches: Sequence[Tensor]) -> CopyBlocksTable:
    """A :class:`CopyBlocksTable` for these caches (per-layer K and V views that stay allocated,
    as the engine's pool does); one blocking upload, here, instead of one per call."""
    ptrs = tuple(t.data_ptr() for t in (*key_caches, *value_caches))
    device = key_caches[0].device if key_caches else torch.device("cpu")
    on_gpu = device.type == "cuda" and _compiled_for(key_caches[0])
    return CopyBlocksTable(ptrs, torch.tensor(ptrs, dtype=torch.int64, device=device) if on_gpu else None)


def copy_blocks(
    key_caches: Sequence[Tensor], value_caches: Sequence[Tensor], block_mapping: Tensor,
    table: CopyBlocksTable | None = None,
) -> None:
    """Copy-on-write: for every layer, copy block ``src`` to ``dst`` for each ``(src, dst)`` row
    of ``block_mapping`` (``[num_pairs, 2]`` int64), in place, in one call.

    A mapping on the CPU is checked entry by entry before any copy (ids < num_blocks, else a
    RuntimeError); on CUDA, pinned CPU memory makes its upload asynchronous. ``table`` (from
    :func:`copy_blocks_table` for the same caches; ValueError otherwise) spares the CUDA path
    the upload of the caches' pointers on every call."""
    if block_mapping.numel() == 0 or not key_caches:
        return
    device_ptrs = None
    if table is not None:
        if table.data_ptrs != tuple(t.data_ptr() for t in (*key_caches, *value_caches)):
            raise ValueError("copy_blocks: the CopyBlocksTable was built for other caches")
        device_ptrs = table.device_ptrs
    if _compiled_for(key_caches[0]):
        torch.ops.paged_serve.copy_blocks(
            list(key_caches), list(value_caches), block_mapping.to(torch.int64), device_ptrs
        )
    else:
        reference.copy_blocks(key_caches, value_caches, block_mapping)


def check_device_errors() -> None:
    """Synchronise the current CUDA device and raise RuntimeError if a CUDA kernel found an
    out-of-range index in device memory since the last check (a slot past the pool, a block id
    outside it, a context longer than max_context_len or its block table). Such entries are
    never used (no memory outside the pool is touched), and the next op call raises too; this
    makes the report immediate. A no-op without the compiled CUDA ops."""
    if backend() != "cuda":
        return
    torch.cuda.synchronize()
    code = torch.ops.paged_serve.take_device_error()
    if code:
        names = {1: "slot >= num_blocks * block_size", 2: "block id outside [0, num_blocks)",
                 3: "context_len < 0 or > max_context_len / the block table's width"}
        raise RuntimeError(f"paged_serve CUDA kernel found an out-of-range index: {names.get(code, code)}")


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy block ``s`` of ``src`` to block ``d`` of ``dst`` for each ``(s, d)`` row of
    ``block_mapping`` (``[num_pairs, 2]`` int64 on the CPU). ``src``/``dst`` are block-major and
    may live on different devices (GPU <-> CPU swap); device copies are asynchronous on the
    current stream."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to("cpu", torch.int64)
    if _compiled_for(src) and _compiled_for(dst):
        torch.ops.paged_serve.swap_blocks(src, dst, mapping)
    else:
        reference.swap_blocks(src, dst, mapping)
