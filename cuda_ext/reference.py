"""Pure-torch reference of every op in :mod:`cuda_ext.ops`.

Slow but obviously correct: the tests compare the compiled kernels against these, and
:mod:`cuda_ext.ops` falls back to them (with a warning) when the extension cannot be built.
Cache layout everywhere: ``[num_blocks, num_kv_heads, block_size, head_size]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write token ``i``'s K/V (``[num_tokens, num_kv_heads, head_size]``) into slot
    ``slot_mapping[i]`` of the caches (in place). A negative slot means skip the token."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # NOTE: advanced indices around a slice move the indexed dims first: the target view is
    # [num_kept_tokens, num_kv_heads, head_size], the same shape as key[keep].
    key_cache[blocks, :, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[keep].to(value_cache.dtype)


def gather_cached_kv(
    key_cache: Tensor, value_cache: Tensor, block_table: Tensor | Sequence[int], context_len: int
) -> tuple[Tensor, Tensor]:
    """K and V of one sequence, ``[context_len, num_kv_heads, head_size]`` each, read through
    its block table (1-D tensor or list of block ids; entries past the context are ignored)."""
    block_size = key_cache.shape[2]
    num_blocks = -(-int(context_len) // block_size)
    table = torch.as_tensor(block_table, dtype=torch.long, device=key_cache.device)[:num_blocks]

    def gather(cache: Tensor) -> Tensor:
        # [n, kv_heads, block_size, head] -> [n * block_size, kv_heads, head]
        blocks = cache[table].transpose(1, 2)
        return blocks.reshape(-1, cache.shape[1], cache.shape[3])[:context_len]

    return gather(key_cache), gather(value_cache)


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
    """Decode attention, one query token per sequence, written into ``out`` (in place).

    ``query``/``out``: ``[num_seqs, num_heads, head_size]``; ``block_tables``:
    ``[num_seqs, max_blocks_per_seq]``; ``context_lens``: ``[num_seqs]``. Query head ``h`` reads
    KV head ``h // (num_heads // num_kv_heads)``. Softmax in fp32. A sequence with context
    length 0 gets zeros. ``max_context_len`` is unused here (kept for the common signature).
    ``window`` > 0: the query (position context_len - 1) sees only the last ``window`` keys;
    ``softcap`` > 0: the scaled logits s become ``softcap * tanh(s / softcap)``.
    """
    del max_context_len
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    lens = context_lens.tolist()
    for i, context_len in enumerate(lens):
        if context_len == 0:
            out[i].zero_()
            continue
        k, v = gather_cached_kv(key_cache, value_cache, block_tables[i], context_len)
        if window > 0:
            k, v = k[max(0, context_len - window):], v[max(0, context_len - window):]
        q = query[i].float().view(num_kv_heads, group, head_size)
        scores = torch.einsum("kgd,tkd->kgt", q, k.float()) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgt,tkd->kgd", probs, v.float())
        out[i].copy_(o.reshape(num_heads, head_size))


def copy_blocks(
    key_caches: Sequence[Tensor], value_caches: Sequence[Tensor], block_mapping: Tensor
) -> None:
    """For every layer's caches, copy block ``src`` to block ``dst`` for each ``(src, dst)`` row
    of ``block_mapping`` (``[num_pairs, 2]``), in place."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=key_caches[0].device, dtype=torch.long)
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy block ``s`` of ``src`` into block ``d`` of ``dst`` for each ``(s, d)`` row of
    ``block_mapping`` (a CPU tensor); ``src`` and ``dst`` may live on different devices."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s], non_blocking=True)


def draw_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor, tokens: Tensor) -> None:
    """The sampler's fused draw, written into ``tokens`` (int64 ``[rows]``): per row,
    ``softmax(logits / temperature)`` (NaN -> -inf, +inf -> the largest float32), the first
    token whose cumulative mass passes ``u`` times the total (in float64, never a token of
    mass 0), then top-p's test: -1 (undecided) unless ``top_p >= 1`` or the tokens strictly
    more likely than the drawn one hold less than ``top_p`` of the mass; -1 also for a row with
    no finite logit."""
    f32 = torch.finfo(torch.float32)
    x = (logits.float() / temperature[:, None]).nan_to_num(nan=float("-inf"), posinf=f32.max, neginf=float("-inf"))
    best = x.max(dim=-1, keepdim=True).values
    alive = best[:, 0] > float("-inf")
    e = torch.where(x == float("-inf"), 0.0, (x - best.clamp(min=-f32.max)).exp()).double()
    total = e.sum(dim=-1)
    cdf = e.cumsum(dim=-1)
    target = u.double() * total
    tok = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=logits.shape[1] - 1)
    chosen = x.gather(1, tok[:, None])
    above = (e * (x > chosen)).sum(dim=-1)
    accepted = (top_p >= 1.0) | (above < top_p.double() * total)
    tokens.copy_(torch.where(alive & accepted, tok, -1))


def score_tokens(logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The compiled ``score_tokens`` in torch: (the targets' logprobs, their ranks as int32, the
    ``k`` best ids and their logprobs) per row. A NaN logprob (a row of -inf, or NaN logits) is
    reported as -inf."""
    logits = logits.float()
    targets = targets.to(device=logits.device, dtype=torch.long)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, targets[:, None])
    ranks = (logits > chosen).sum(dim=-1, dtype=torch.int32) + 1
    logprobs = (chosen - lse)[:, 0]
    values, ids = torch.topk(logits, k, dim=-1) if k > 0 else (logits[:, :0], logits[:, :0].long())
    values = values - lse
    neg_inf = float("-inf")
    return logprobs.masked_fill_(logprobs.isnan(), neg_inf), ranks, ids, values.masked_fill_(values.isnan(), neg_inf)


# The model's elementwise work (the compiled versions fuse each into one pass: cpu/fused.cpp).
# These are what engine/worker/models/layers.py always ran; the compiled ones match them to rounding.


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weight * RMS-normalised (x + residual), x + residual); statistics in float32."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate ``query`` [T, heads, d] and ``key`` [T, kv_heads, d] in place by the rows
    ``positions`` of ``cos`` / ``sin`` [max_positions, d] (NeoX / HF rotate-half layout)."""
    c = cos[positions].unsqueeze(1).to(query.dtype)
    s = sin[positions].unsqueeze(1).to(query.dtype)
    query.copy_(query * c + rotate_half(query) * s)
    key.copy_(key * c + rotate_half(key) * s)


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# GGUF-quantized weights (the compiled ops: cpu/quant_*.cpp; the packed format: cpu/quant_format.h).
# The reference keeps ggml's rows as given behind the same header (layout 1); its products
# dequantize with gguf.quants.dequantize and quantize the activations as the kernels do.

QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
GGML_TYPE_IDS = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14}
_QUANT_NAMES = {v: k for k, v in GGML_TYPE_IDS.items()}
QUANT_MAGIC = 0x31544E4155515350  # "PSQUANT1"
QUANT_VERSION = 1
LAYOUT_PANELS, LAYOUT_ROWS = 0, 1
_HEADER_WORDS, _SEGMENT_WORDS, _ALIGN = 8, 4, 64


def quant_block(qtype: str) -> tuple[int, int]:
    """(elements, bytes) of one ggml block of `qtype` (ValueError for a type not served)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype not in GGML_TYPE_IDS:
        raise ValueError(f"quantized type {qtype!r} is not one of {QUANT_TYPES}")
    return GGML_QUANT_SIZES[GGMLQuantizationType(GGML_TYPE_IDS[qtype])]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def parse_quant_header(packed: Tensor) -> tuple[int, int, int, list[tuple[str, int, int, int]]]:
    """(layout, N, K, [(qtype, rows, byte offset, bytes) per segment]) of a packed weight;
    ValueError for anything but a quant_pack header."""
    if not (isinstance(packed, Tensor) and packed.dtype == torch.uint8 and packed.dim() == 1
            and packed.numel() >= 8 * _HEADER_WORDS):
        raise ValueError("packed must be the 1-D uint8 tensor quant_pack returns")
    words = packed[: 8 * _HEADER_WORDS].clone().view(torch.int64).tolist()
    if words[0] != QUANT_MAGIC or words[1] != QUANT_VERSION:
        raise ValueError("packed does not start with quant_pack's header (magic / version)")
    layout, n, k, nseg, header, total = words[2:8]
    if not (1 <= nseg <= 64 and header == _align(8 * (_HEADER_WORDS + _SEGMENT_WORDS * nseg))
            and total == packed.numel()):
        raise ValueError(f"packed header (segments {nseg}, {header} / {total} bytes) disagrees with its "
                         f"{packed.numel()} bytes")
    seg_words = packed[8 * _HEADER_WORDS: 8 * (_HEADER_WORDS + _SEGMENT_WORDS * nseg)].clone().view(torch.int64)
    segments = []
    for tid, rows, offset, nbytes in seg_words.view(nseg, _SEGMENT_WORDS).tolist():
        if tid not in _QUANT_NAMES:
            raise ValueError(f"packed segment of ggml type id {tid}, not a served type")
        segments.append((_QUANT_NAMES[tid], rows, offset, nbytes))
    if sum(s[1] for s in segments) != n:
        raise ValueError(f"packed segments hold {sum(s[1] for s in segments)} rows, the header says {n}")
    return layout, n, k, segments


def quant_info(packed: Tensor) -> tuple[int, int, list[tuple[str, int]]]:
    """(N, K, [(qtype, rows) per segment]) of a packed weight (either layout)."""
    _, n, k, segments = parse_quant_header(packed)
    return n, k, [(q, rows) for q, rows, _, _ in segments]


def _check_parts(parts: Sequence[tuple[Tensor, str]]) -> int:
    """K of the row segments (each uint8 [rows, row_bytes] of whole ggml blocks, one K)."""
    if not parts:
        raise ValueError("quant_pack needs at least one part")
    k = None
    for i, (part, qtype) in enumerate(parts):
        block, nbytes = quant_block(qtype)
        if part.dtype != torch.uint8 or part.dim() != 2 or part.shape[0] < 1:
            raise ValueError(f"quant_pack: part {i} ({qtype}) must be a 2-D uint8 tensor [rows, row_bytes]")
        if part.shape[1] == 0 or part.shape[1] % nbytes:
            raise ValueError(f"quant_pack: part {i} ({qtype}) has {part.shape[1]} bytes per row, not a whole "
                             f"number of {qtype}'s {nbytes}-byte blocks")
        part_k = part.shape[1] // nbytes * block
        if k is not None and part_k != k:
            raise ValueError(f"quant_pack: part {i} ({qtype}) holds rows of K = {part_k}, part 0 of K = {k}")
        k = part_k
    return k


def quant_pack(parts: Sequence[tuple[Tensor, str]]) -> Tensor:
    """The reference's packed weight: quant_pack's header (layout 1) over ggml's rows as given."""
    k = _check_parts(parts)
    nseg = len(parts)
    header = _align(8 * (_HEADER_WORDS + _SEGMENT_WORDS * nseg))
    offset, seg_words = header, []
    for part, qtype in parts:
        seg_words += [GGML_TYPE_IDS[qtype], part.shape[0], offset, part.numel()]
        offset = _align(offset + part.numel())
    out = torch.zeros(offset, dtype=torch.uint8)
    words = [QUANT_MAGIC, QUANT_VERSION, LAYOUT_ROWS, sum(p.shape[0] for p, _ in parts), k, nseg, header, offset]
    out[: 8 * len(words + seg_words)] = torch.tensor(words + seg_words, dtype=torch.int64).view(torch.uint8)
    for (part, _), start in zip(parts, seg_words[2::4]):
        out[start: start + part.numel()] = part.contiguous().view(-1)
    return out


def _ggml_segments(packed: Tensor) -> tuple[int, list[tuple[Tensor, str]]]:
    layout, _, k, segments = parse_quant_header(packed)
    if layout != LAYOUT_ROWS:
        raise ValueError("this packed weight holds the compiled kernels' panels; the reference reads only its own")
    return k, [(packed[off: off + nbytes].view(rows, -1), q) for q, rows, off, nbytes in segments]


def dequantize_ggml(data: Tensor, qtype: str) -> Tensor:
    """float32 [rows, K] of ggml blocks [rows, row_bytes] (gguf.quants.dequantize)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    quant_block(qtype)
    return torch.from_numpy(dequantize(data.numpy(), GGMLQuantizationType(GGML_TYPE_IDS[qtype])).copy())


def quantize_activations(x: Tensor, block: int, fp16_scale: bool) -> tuple[Tensor, Tensor]:
    """(q int8 [M, K], d float32 [M, K / block]): x's rows quantized as the kernels do, in the
    same float32 operations: amax per block, d = amax / 127 (rounded to fp16 for q8_0's blocks of
    32, fp32 for q8_K's of 256), q = round-half-even(x * (127 / amax))."""
    import numpy as np

    xf = x.float().numpy()
    m, k = xf.shape
    xb = xf.reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8).reshape(m, k)
    d = (amax / np.float32(127)).astype(np.float32)
    if fp16_scale:
        d = d.astype(np.float16).astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(d)


def quant_matmul_ggml(x: Tensor, parts: Sequence[tuple[Tensor, str]], bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias) in float64 for W given as ggml row segments: x's activations quantized as
    the kernels quantize them (per segment: q8_0 for the legacy types, q8_K for the K types),
    the weights dequantized by gguf, the product and sums in float64."""
    x2 = x.reshape(-1, x.shape[-1])
    acts = {}
    outs = []
    for data, qtype in parts:
        block = 256 if qtype.endswith("_k") else 32
        if block not in acts:
            q, d = quantize_activations(x2, block, fp16_scale=block == 32)
            acts[block] = (q.double().view(q.shape[0], -1, block) * d.double()[..., None]).view(q.shape)
        outs.append(acts[block] @ dequantize_ggml(data, qtype).double().T)
    y = torch.cat(outs, dim=-1)
    return y if bias is None else y + bias.double()


def quant_matmul(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """The reference quant_matmul over its own packed weight: [M, N] in x's dtype."""
    _, parts = _ggml_segments(packed)
    return quant_matmul_ggml(x, parts, bias).to(x.dtype)


def quant_silu_mul(x: Tensor, packed: Tensor) -> Tensor:
    """silu(x G^T) * (x U^T) for a packed [G | U], in x's dtype."""
    _, parts = _ggml_segments(packed)
    gate, up = quant_matmul_ggml(x, parts).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def quant_dequantize(packed: Tensor) -> Tensor:
    """float32 [N, K] of the reference's packed weight."""
    _, parts = _ggml_segments(packed)
    return torch.cat([dequantize_ggml(data, qtype) for data, qtype in parts])


def quant_embedding(packed: Tensor, ids: Tensor) -> Tensor:
    """float32 rows `ids` of the reference's packed weight."""
    return quant_dequantize(packed)[ids]


def quantize_ggml(weight: Tensor, qtype: str) -> Tensor:
    """weight [N, K] as ggml blocks [N, row_bytes] (gguf.quants.quantize: the legacy types)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    quant_block(qtype)
    if qtype not in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        raise NotImplementedError(f"gguf-py has no {qtype} quantizer: quantizing to it needs the compiled ops")
    w = weight.detach().float().contiguous().numpy()
    return torch.from_numpy(quantize(w, GGMLQuantizationType(GGML_TYPE_IDS[qtype])).copy())
