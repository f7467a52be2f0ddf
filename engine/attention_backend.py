"""The attention-backend seam: how one step's flattened token batch maps onto sequences and cache
slots (`build_metadata`), and how one layer attends with it (`forward`). The model's
`PagedAttention` layers call the backend that built the step's metadata, so a backend (a GPU
varlen prefill kernel, say) replaces the per-sequence SDPA loop without touching the model runner
or the model. `TorchPagedBackend` is the portable one: SDPA for prefills, the compiled
`paged_attention` op for decodes, every cache access through `cuda_ext.ops`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cuda_ext import ops

if TYPE_CHECKING:
    from engine.model_runner import SeqInput
    from engine.table_rows import TableRows


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence's tokens in the flattened batch
    end: int  # one past its last row
    num_cached: int  # tokens of this sequence already in the cache before this step
    block_table: torch.Tensor | None  # [num_blocks] int64 physical block ids (only when num_cached > 0)


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
        bs, dev = self.block_size, self.device
        slots = array("q")
        prefills: list[PrefillSpan] = []
        decode_tables: list = []  # the decodes' block tables (array('i'), or lists)
        decode_lens = array("i")
        decode_rows = array("q")  # their rows in `table_rows`
        row = 0
        for s in seqs:
            table, start = s.block_table, s.start
            n = len(s.token_ids)
            if n == 1:
                p = start
                slots.append(table[p // bs] * bs + p % bs)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if s.is_prefill:
                bt = _tensor(array("q", table), torch.int64, dev) if start else None
                prefills.append(PrefillSpan(row, row + n, start, bt))
            else:
                decode_tables.append(table)
                decode_lens.append(start + n)
                decode_rows.append(s.block_row)
            row += n
        meta = AttentionMetadata(self, _tensor(slots, torch.int64, dev), prefills,
                                 prefills[-1].end if prefills else 0, None, None, max(decode_lens, default=0))
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            if table_rows is not None and min(decode_rows) >= 0:
                # NOTE: one sequential pass over one matrix (engine/table_rows.py), its rows zero
                # past each table, rather than a copy of every table (cache misses per block).
                matrix = torch.frombuffer(table_rows.data, dtype=torch.int32).view(table_rows.num_rows,
                                                                                  table_rows.width)
                rows = torch.frombuffer(decode_rows, dtype=torch.int64)
                meta.decode_block_tables = matrix[:, :width].index_select(0, rows).to(dev)
            else:  # a tensor-parallel worker's step, or tables of another origin (tests)
                flat, zeros = array("i"), array("i", bytes(4 * width))
                for t in decode_tables:  # NOTE: array('i') tables: a memcpy each
                    flat.extend(t)
                    if len(t) < width:
                        flat.extend(zeros[: width - len(t)])
                meta.decode_block_tables = _tensor(flat, torch.int32, dev).view(len(decode_tables), width)
            meta.decode_context_lens = _tensor(decode_lens, torch.int32, dev)
        return meta

    def forward(self, layer, q, k, v, meta: AttentionMetadata, kv_cache):
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for span in meta.prefills:
            qs = q[span.start : span.end]
            if span.num_cached == 0:
                ks, vs = k[span.start : span.end], v[span.start : span.end]
            else:
                ks, vs = ops.gather_cached_kv(
                    key_cache, value_cache, span.block_table, span.num_cached + span.end - span.start
                )
            out[span.start : span.end] = _prefill(qs, ks, vs, span.num_cached, layer.scale)
        P = meta.num_prefill_tokens
        if P < q.shape[0]:
            ops.paged_attention(out[P:], q[P:], key_cache, value_cache, meta.decode_block_tables,
                                meta.decode_context_lens, layer.scale, meta.max_decode_context_len)
        return out


def _tensor(values: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (an array of the matching C type: no per-element Python work)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(values, dtype=dtype).to(device, copy=True)


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
