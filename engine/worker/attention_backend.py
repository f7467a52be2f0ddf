"""The attention-backend seam: how one step's flattened token batch maps onto sequences and cache
slots (`build_metadata`), and how one layer attends with it (`forward`). The model's
`PagedAttention` layers call the backend that built the step's metadata, so a backend (a GPU
varlen prefill kernel, say) replaces the per-sequence SDPA loop without touching the model runner
or the model. `TorchPagedBackend` is the portable one: for prefills the compiled one-call
`prefill_attention` op on a CPU (fp32, bf16), SDPA per sequence elsewhere; the compiled
`paged_attention` op for decodes; every cache access through `cuda_ext.ops`. A layer with a
sliding window or a logit soft-cap (`PagedAttention.sliding_window` / `.logit_softcap`) hands
them to the compiled CPU kernels, which compute both; where those do not run (off a CPU, the
reference ops, prompts the prefill kernel does not take) it attends in torch
(engine/worker/window_attention.py) instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cuda_ext import ops
from engine.worker.window_attention import attend, first_block

if TYPE_CHECKING:
    from engine.core.step import SeqInput
    from engine.core.table_rows import TableRows


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence's tokens in the flattened batch
    end: int  # one past its last row
    num_cached: int  # tokens of this sequence already in the cache before this step
    # [num_blocks] int64 physical block ids, when num_cached > 0 off a CPU (on a CPU the table is
    # a row of AttentionMetadata.prefill_tables)
    block_table: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """How the flattened token batch of one step maps onto sequences and cache slots.
    Prefill tokens come first (rows [0, num_prefill_tokens)), then one row per decode sequence."""

    backend: AttentionBackend  # the backend that built it, which the layers call
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of every token (-1: do not cache)
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token
    max_decode_context_len: int
    # The prefills for the CPU kernel (ops.prefill_attention), when this step has some on a CPU:
    # [num_prefills, 3] int32 (first row, tokens, num_cached) and their block tables
    # [num_prefills, max_blocks] int32.
    prefill_spans: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    # The longest context (cached + new tokens) of any sequence in this step; None: unknown.
    max_context_len: int | None = None
    # With KV layer groups (engine/core/kv_layout.py): each group's metadata, this one first (the
    # same tokens over that group's block tables); a layer reads `groups[layer.kv_group]`.
    groups: list[AttentionMetadata] | None = None


class AttentionBackend(ABC):
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    @abstractmethod
    def build_metadata(self, seqs: list[SeqInput], table_rows: TableRows | None = None) -> AttentionMetadata:
        """The step's metadata; `seqs` in batch order, prefills first. `table_rows`: the block
        tables as matrix rows (each decode's `block_row`), when the step carries them."""

    @abstractmethod
    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Write this step's K/V into their slots, then attend. q: [T, heads, d], k/v:
        [T, kv_heads, d]; returns [T, heads, d]. `layer` gives the head counts and scale."""


class TorchPagedBackend(AttentionBackend):
    def build_metadata(self, seqs: list[SeqInput], table_rows: TableRows | None = None) -> AttentionMetadata:
        meta = self._build(seqs, table_rows, 0)
        num_groups = 1 + len(seqs[0].group_tables) if seqs else 1
        if num_groups > 1:
            # NOTE: the other groups' decode tables are copied (their rows are not mirrored)
            meta.groups = [meta] + [self._build(seqs, None, k) for k in range(1, num_groups)]
        return meta

    def _build(self, seqs: list[SeqInput], table_rows: TableRows | None, group: int) -> AttentionMetadata:
        """The metadata over KV layer group `group`'s tables (`SeqInput.block_table` for 0)."""
        bs, dev = self.block_size, self.device
        slots = array("q")
        prefills: list[PrefillSpan] = []
        decode_tables: list = []  # the decodes' block tables (array('i'), or lists)
        decode_lens = array("i")
        decode_rows = array("q")  # their rows in `table_rows`
        # NOTE: on a CPU the prefills' tables go to the one-call kernel (which reads the cached
        # prefix through them) instead of one tensor per span for the SDPA loop's gather.
        on_cpu = dev.type == "cpu"
        spans = array("i")
        prefill_tables: list = []
        row = longest = 0
        for s in seqs:
            table, start = (s.block_table if group == 0 else s.group_tables[group - 1]), s.start
            n = len(s.token_ids)
            if n == 1:
                p = start
                slots.append(table[p // bs] * bs + p % bs)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if s.is_prefill:
                bt = _tensor(array("q", table), torch.int64, dev) if start and not on_cpu else None
                prefills.append(PrefillSpan(row, row + n, start, bt))
                if on_cpu:
                    spans.extend((row, n, start))
                    prefill_tables.append(table)
            else:
                decode_tables.append(table)
                decode_lens.append(start + n)
                decode_rows.append(s.block_row)
            row += n
            longest = max(longest, start + n)
        meta = AttentionMetadata(self, _tensor(slots, torch.int64, dev), prefills,
                                 prefills[-1].end if prefills else 0, None, None, max(decode_lens, default=0),
                                 max_context_len=longest)
        if prefill_tables:
            meta.prefill_spans = torch.frombuffer(spans, dtype=torch.int32).view(-1, 3)
            meta.prefill_tables = _table_matrix(prefill_tables, dev)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            if table_rows is not None and min(decode_rows) >= 0:
                # NOTE: one sequential pass over one matrix (engine/core/table_rows.py), its rows zero
                # past each table, rather than a copy of every table (cache misses per block).
                matrix = torch.frombuffer(table_rows.data, dtype=torch.int32).view(table_rows.num_rows,
                                                                                  table_rows.width)
                rows = torch.frombuffer(decode_rows, dtype=torch.int64)
                meta.decode_block_tables = matrix[:, :width].index_select(0, rows).to(dev)
            else:  # a tensor-parallel worker's step, or tables of another origin (tests)
                meta.decode_block_tables = _table_matrix(decode_tables, dev)
            meta.decode_context_lens = _tensor(decode_lens, torch.int32, dev)
        return meta

    def forward(self, layer, q, k, v, meta: AttentionMetadata, kv_cache):
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        window, softcap = _window_and_cap(layer, meta)
        if not _kernels_apply(window, softcap, q, key_cache, meta):
            self._attend_exact(layer, q, k, v, meta, key_cache, value_cache, out)
            return out
        P = meta.num_prefill_tokens
        if meta.prefill_spans is not None and _prefill_kernel_applies(q, key_cache):
            ops.prefill_attention(out[:P], q[:P], key_cache, value_cache, meta.prefill_tables, meta.prefill_spans,
                                  layer.scale, window, softcap)
        else:
            self._prefill_each(layer, q, k, v, meta, key_cache, value_cache, out)
        if P < q.shape[0]:
            ops.paged_attention(out[P:], q[P:], key_cache, value_cache, meta.decode_block_tables,
                                meta.decode_context_lens, layer.scale, meta.max_decode_context_len, window, softcap)
        return out

    @staticmethod
    def _prefill_each(layer, q, k, v, meta: AttentionMetadata, key_cache, value_cache, out) -> None:
        """SDPA per prefill span (the path off the CPU kernel), the cached prefix gathered."""
        for i, span in enumerate(meta.prefills):
            qs = q[span.start : span.end]
            if span.num_cached == 0:
                ks, vs = k[span.start : span.end], v[span.start : span.end]
            else:
                table = span.block_table
                if table is None:  # built for the CPU kernel, which does not apply to these tensors
                    table = meta.prefill_tables[i]
                ks, vs = ops.gather_cached_kv(key_cache, value_cache, table, span.num_cached + span.end - span.start)
            out[span.start : span.end] = _prefill(qs, ks, vs, span.num_cached, layer.scale)


    @staticmethod
    def _attend_exact(layer, q, k, v, meta: AttentionMetadata, key_cache, value_cache, out) -> None:
        """Every prefill span and decode in torch with the layer's window and soft-cap, each
        sequence's cached K/V gathered through its block table (only the blocks its window
        reaches; a fresh prompt reads its own rows of k/v). The step's K/V are already cached."""
        window, cap, scale, bs = layer.sliding_window, layer.logit_softcap, layer.scale, key_cache.shape[2]
        for i, span in enumerate(meta.prefills):
            rows = slice(span.start, span.end)
            if span.num_cached == 0:
                ks, vs, k_start = k[rows], v[rows], 0
            else:
                table = span.block_table if span.block_table is not None else meta.prefill_tables[i]
                b = first_block(span.num_cached, window, bs)
                _check_live(table[b])
                ks, vs = ops.gather_cached_kv(key_cache, value_cache, table[b:],
                                              span.num_cached + span.end - span.start - b * bs)
                k_start = b * bs
            out[rows] = attend(q[rows], ks, vs, span.num_cached, k_start, scale, window, cap)
        P = meta.num_prefill_tokens
        if P == q.shape[0]:
            return
        for j, ctx in enumerate(meta.decode_context_lens.tolist()):
            b = first_block(ctx - 1, window, bs)
            _check_live(meta.decode_block_tables[j, b])
            ks, vs = ops.gather_cached_kv(key_cache, value_cache, meta.decode_block_tables[j, b:], ctx - b * bs)
            out[P + j:P + j + 1] = attend(q[P + j:P + j + 1], ks, vs, ctx - 1, b * bs, scale, window, cap)


def _check_live(entry: torch.Tensor) -> None:
    """Assert that the first table entry a windowed read starts at holds a block: the block
    manager gives back (RELEASED, -1) exactly the blocks before `first_block`, so a negative one
    here means the layer's window and the KV layout's disagree (engine/core/kv_layout.py)."""
    # NOTE: one entry per sequence and layer: blocks after it are live too (the released ones
    # are a prefix of the table); the compiled kernels, given the window, start reading at the
    # same position (max(0, context - W)), and without one only run when no context outgrows
    # the window (`_window_and_cap`), when nothing was given back.
    assert int(entry) >= 0, "attention would read a KV block given back (out of the window)"


def _window_and_cap(layer, meta: AttentionMetadata) -> tuple[int, float]:
    """The window and soft-cap the kernels must compute for this layer and step (0: none, as
    ops.paged_attention / prefill_attention take them): the layer's soft-cap, and its window
    unless no context of the step outgrows it (a context of at most W tokens sees all of them)."""
    softcap = getattr(layer, "logit_softcap", None) or 0.0
    window = getattr(layer, "sliding_window", None) or 0
    if window and meta.max_context_len is not None and meta.max_context_len <= window:
        window = 0
    return window, softcap


def _kernels_apply(window: int, softcap: float, q: torch.Tensor, key_cache: torch.Tensor,
                   meta: AttentionMetadata) -> bool:
    """Whether the kernels of `forward` compute this layer's attention for this step: always
    without a window or soft-cap to compute; with one, the compiled CPU kernels on CPU tensors
    (the decode kernel takes every dtype and head size, the prefill kernel what
    `_prefill_kernel_applies` says), not SDPA per span nor the CUDA kernels."""
    if not window and not softcap:
        return True
    if q.device.type != "cpu" or ops.backend() == "reference":
        return False
    return meta.num_prefill_tokens == 0 or (meta.prefill_spans is not None and _prefill_kernel_applies(q, key_cache))


def _table_matrix(tables: list, device: torch.device) -> torch.Tensor:
    """Block tables (array('i') or lists) as one [len(tables), longest] int32 matrix, zero-padded."""
    width = max(len(t) for t in tables)
    flat, zeros = array("i"), array("i", bytes(4 * width))
    for t in tables:  # NOTE: array('i') tables: a memcpy each
        flat.extend(t)
        if len(t) < width:
            flat.extend(zeros[: width - len(t)])
    return _tensor(flat, torch.int32, device).view(len(tables), width)


def _tensor(values: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (an array of the matching C type: no per-element Python work)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(values, dtype=dtype).to(device, copy=True)


def _prefill_kernel_applies(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ops.prefill_attention runs these tensors: fp32 or bf16 (one dtype) on a CPU, a head
    size that is a multiple of 16, the kernel built (AVX2 + FMA)."""
    return (q.dtype in (torch.float32, torch.bfloat16) and key_cache.dtype == q.dtype and q.device.type == "cpu"
            and q.shape[-1] % 16 == 0 and ops.prefill_attention_available())


def _prefill(q, k, v, num_cached: int, scale: float) -> torch.Tensor:
    """Causal attention of q (the new tokens, positions num_cached..) over k/v (all tokens)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, L, d]
    if num_cached == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        L, S = q.shape[2], k.shape[2]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
