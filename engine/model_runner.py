"""Turns a `SchedulerOutput` into batch tensors, runs the model, returns the logits.

It carries out the step's block moves (swap out, swap in, copy-on-write) before the forward
pass and never decides anything itself: block ids come in the scheduler's output.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.cache_engine import CacheEngine
from engine.config import ModelConfig
from engine.models.llama import model_class
from engine.models.loader import load_weights
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int):
        self.config = model_config
        self.device = device
        self.block_size = block_size
        t0 = time.perf_counter()
        torch.manual_seed(model_config.seed)
        with torch.device(device):
            self.model = model_class(model_config.hf_config)(model_config.hf_config, model_config.max_model_len)
        self.model.to(dtype=model_config.dtype)
        self.model.eval()
        load_weights(self.model, model_config.path, model_config.load_format, model_config.seed)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info(
            "model ready: %s, %.1f M parameters, %s on %s, in %.1f s",
            model_config.served_model_name,
            self.weights_bytes / torch.tensor([], dtype=model_config.dtype).element_size() / 1e6,
            str(model_config.dtype).removeprefix("torch."),
            device,
            time.perf_counter() - t0,
        )
        self.cache: CacheEngine | None = None

    def attach_cache(self, cache: CacheEngine) -> None:
        self.cache = cache

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Runs the step; returns float32 logits [len(step.scheduled), vocab], one row per
        scheduled sequence (its last token's)."""
        cache = self.cache
        cache.swap_out(step.blocks_to_swap_out)
        cache.swap_in(step.blocks_to_swap_in)
        cache.copy(step.blocks_to_copy)
        if not step.scheduled:
            return torch.empty(0, self.config.hf_config.vocab_size)
        input_ids, positions, meta, last_rows = self._prepare(step)
        hidden = self.model(input_ids, positions, meta, cache.kv_caches)
        return self.model.compute_logits(hidden[last_rows]).float()

    def _prepare(self, step: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        last_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for s in step.scheduled:
            seq, table = s.seq, s.block_table
            start, end = seq.num_computed_tokens, len(seq)
            row0 = len(ids)
            ids.extend(seq.token_ids[start:end] if s.is_prefill else [seq.last_token_id])
            positions = range(start, end)
            pos.extend(positions)
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            last_rows.append(len(ids) - 1)
            if s.is_prefill:
                bt = torch.tensor(table, dtype=torch.int64, device=self.device) if start else None
                prefills.append(PrefillSpan(row0, len(ids), start, bt))
            else:
                decode_tables.append(table)
                decode_lens.append(end)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            prefills=prefills,
            num_prefill_tokens=prefills[-1].end if prefills else 0,
            decode_block_tables=None,
            decode_context_lens=None,
            max_decode_context_len=max(decode_lens, default=0),
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.int32, device=dev)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
        return (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(last_rows, dtype=torch.int64, device=dev),
        )
