"""Turns a `StepInput` into batch tensors, runs the model, returns the logits (and, for
prompt logprobs, the scores of every prompt token, reduced chunk by chunk; see `execute`).

`StepInput` (engine/core/step.py) is the lean, picklable description of one step that
the driver builds from the scheduler's output and, with tensor parallelism, sends to every
worker: token ids, positions and block tables, never `Sequence` objects. The runner carries out the step's block moves (swap
out, swap in, copy-on-write) before the forward pass and never decides anything itself.
With tensor parallelism each rank runs this same code on its shard of the weights and of the
KV heads; the layers communicate (engine/worker/models/layers.py). With pipeline parallelism
each rank builds and loads its stage's modules only (engine/worker/stage_layout.py), holds its
layers' KV pool only and runs the step through its `PipelineStage` (engine/worker/
pipeline_stage.py); stage 0 computes the logits.
"""

from __future__ import annotations

from array import array

import copy
import dataclasses
import logging
import time

import torch

from cuda_ext import ops
from engine.core.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.core.step import SampleResult, SeqInput, StepInput, StepOutput
from engine.sample.sampler import score_tokens
from engine.worker import parallel
from engine.worker.attention_backend import TorchPagedBackend
from engine.core.kv_layout import KvLayout
from engine.worker.attention import PagedAttention
from engine.worker.cache_engine import CacheEngine, kv_layout_for, num_blocks_from_budget, whole_layout
from engine.worker.models import gguf_weights, linear_kernel
from engine.worker.models.decoder_stack import use_compiled_stack
from engine.worker.models.layers import use_fused_ops
from engine.worker.models.registry import model_class
from engine.worker.models.loader import is_gguf, load_weights
from engine.worker.models.quant_linear import describe_footprint, weight_footprint
from engine.worker.models.quantize import quantize_linear_layers
from engine.worker.pipeline_stage import PipelineStage
from engine.worker.stage_layout import StageLayout

logger = logging.getLogger(__name__)

class ModelRunner:
    """This rank's model shard and KV pool. Build it after torch.distributed is initialised
    (tensor parallelism) so that the layers take their shard."""

    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int,
                 micro_batches: int | None = None):
        """`micro_batches`: how many a pipeline stage cuts each step into (None: one per stage)."""
        self.device = device
        self.block_size = block_size
        self.tp_size = parallel.world_size()
        self.layout = StageLayout.of_this_rank(model_config.num_layers)
        pipelined = self.layout.num_stages > 1
        # NOTE: the full config builds the model (its classes build this stage's modules only,
        # engine/worker/stage_layout.py); the stage's counts its own layers, for the KV pool.
        self.config = _stage_config(model_config, len(self.layout.layers)) if pipelined else model_config
        t0 = time.perf_counter()
        torch.manual_seed(model_config.seed)
        if is_gguf(model_config.path):
            # NOTE: built on the meta device: quantized layers never allocate dense weights
            self.model = gguf_weights.build_model(model_config, device)
        else:
            self.model = self._dense_model(model_config, device)
        self.model.eval()
        self.stage: PipelineStage | None = None
        if pipelined:
            self.stage = PipelineStage(self.model, self.layout, model_config.hf_config.hidden_size, model_config.dtype,
                                       device, micro_batches or self.layout.num_stages)
            logger.info("pipeline stage %d of %d: decoder layers %d..%d%s", self.layout.stage, self.layout.num_stages,
                        self.layout.layers.start, self.layout.layers.stop - 1,
                        ", the embedding and the LM head" if self.layout.first else "")
        by_type, num_params = weight_footprint(self.model)
        # NOTE: packed bytes for quantized layers: this is what the KV pool's budget leaves out
        self.weights_bytes = sum(by_type.values())
        logger.info("weights: %s", describe_footprint(by_type))
        self.linear_kernel, why = linear_kernel.choose(self.model, model_config.linear_kernel, device, model_config.dtype)
        if self.linear_kernel in ("onednn", "panels"):
            linear_kernel.pack(self.model, self.linear_kernel)
        logger.info("linear layers: %s (%s)", self.linear_kernel, why)
        fused = model_config.fused_ops and device.type == "cpu" and ops.backend() == "cpu"
        use_fused_ops(self.model, fused)
        logger.info("elementwise layers (RMSNorm, rotary, SiLU x up): %s", "compiled one-pass ops" if fused else "torch")
        why_not = use_compiled_stack(self.model, device, self.tp_size, fused and not pipelined)
        if pipelined:
            why_not = "pipeline parallelism: a stage runs a slice of the layers and hands on its residual"
        logger.info("decoder layers: %s", "one compiled call per step (ops.decoder_stack)" if why_not is None
                    else f"layer by layer in Python ({why_not})")
        if linear_kernel.reduced_precision_is_slow(device, model_config.dtype):
            logger.warning(
                "%s on a CPU without native %s matmuls (AVX512-BF16/FP16, AMX or AVX-NE-CONVERT): every product "
                "converts to float32 on the fly, several times slower than --dtype float32",
                str(model_config.dtype).removeprefix("torch."), str(model_config.dtype).removeprefix("torch."),
            )
        logger.info(
            "model ready: %s, %.1f M parameters%s, %s on %s, in %.1f s",
            model_config.served_model_name,
            num_params / 1e6,
            f" (rank {parallel.rank()} of {self.tp_size})" if self.tp_size > 1 else "",
            str(model_config.dtype).removeprefix("torch."),
            device,
            time.perf_counter() - t0,
        )
        self.cache: CacheEngine | None = None
        self.attn_backend = TorchPagedBackend(block_size, device)
        self.kv_layout: KvLayout = whole_layout(model_config.num_layers)  # `num_blocks` sets the model's

    @staticmethod
    def _dense_model(model_config: ModelConfig, device: torch.device) -> torch.nn.Module:
        """The model from an HF directory (or dummy weights), its linear layers quantized at load
        with --quantization TYPE."""
        with torch.device(device):
            model = model_class(model_config.hf_config)(model_config.hf_config, model_config.max_model_len)
        model.to(dtype=model_config.dtype)
        load_weights(model, model_config.path, model_config.load_format, model_config.seed)  # or dummy ones
        if model_config.quantized:
            why = gguf_weights.kernels_unavailable(device)
            if why is not None:
                raise ValueError(f"--quantization {model_config.quantization}: {why}; use --quantization none")
            t0 = time.perf_counter()
            count = quantize_linear_layers(model, model_config.quantization)
            logger.info("quantized %d linear layers to %s in %.1f s", count, model_config.quantization,
                        time.perf_counter() - t0)
        return model

    def num_blocks(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig | None = None) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that this rank's memory budget allows for its KV heads
        (the scheduler's max_num_seqs and preemption mode bound what the default pools need).
        Fixes the KV layer groups (`kv_layout_for`) that `init_cache` lays the pool out in."""
        self.kv_layout = kv_layout_for(self.config, cache_config)
        return num_blocks_from_budget(self.config, cache_config, self.device, self.weights_bytes, self.tp_size,
                                      scheduler_config, ranks=self.tp_size * self.layout.num_stages,
                                      layout=self.kv_layout)

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        """Allocate this rank's KV pools (once, at start-up) in `kv_layout`'s groups, and tell each
        attention layer its group (whose block table it reads)."""
        layout = self.kv_layout
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        assert len(layers) == self.config.num_layers, "one PagedAttention per layer"
        for i, attn in enumerate(layers):
            k = layout.place(i)[0]
            # NOTE: the block manager gives back what the group's window no longer reaches: the
            # layer must attend within that same window (or the layout keeps everything).
            window = layout.groups[k].window
            assert window is None or attn.sliding_window == window, f"layer {i}: window {attn.sliding_window} != {window}"
            attn.kv_group = k
        if len(layout.groups) > 1:
            # NOTE: the compiled stack reads one block table for every layer
            use_compiled_stack(self.model, self.device, self.tp_size, False)
            logger.info("KV layer groups: %d of %d layers (windows %s); decoder layers in Python (the compiled "
                        "stack reads one block table for every layer)", len(layout.groups), layout.slots,
                        layout.windows)
        self.cache = CacheEngine(
            self.config, self.block_size, num_device_blocks, num_cpu_blocks, self.device, self.tp_size, layout
        )
        return self.cache

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Runs the step; returns each sequence's last-token logits and, for sequences with
        `prompt_logprobs`, the scores of their other computed tokens (`StepOutput`). Those rows
        go through the LM head `step.logit_chunk_rows` at a time, each chunk reduced to its
        scores at once, so no more full-vocabulary rows than that (or than sequences) exist at
        any time. Every rank makes the same LM-head calls. Mutates the KV pools only."""
        cache = self.cache
        cache.swap_out(step.blocks_to_swap_out)
        cache.swap_in(step.blocks_to_swap_in)
        cache.copy(step.blocks_to_copy)
        if not step.seqs:
            return StepOutput(torch.empty(0, self.config.hf_config.vocab_size))
        if self.stage is not None:
            return self._execute_stage(step)
        input_ids, positions, meta, rows = self._prepare(step)
        # NOTE: the model carries only `rows` past the last layer's attention when that leaves
        # any token out (a prefill's other prompt tokens); a step of decodes keeps them all.
        cut = len(rows) < len(input_ids)
        hidden = self.model(input_ids, positions, meta, cache.kv_caches, rows if cut else None)
        if not cut:
            hidden = hidden.index_select(0, rows)
        num_seqs = len(step.seqs)
        logits = self.model.compute_logits(hidden[:num_seqs]).float()
        return StepOutput(logits, self._prompt_scores(step, hidden[num_seqs:]))

    def _execute_stage(self, step: StepInput) -> StepOutput:
        """`execute` on a pipeline stage: the logits on stage 0, an empty output elsewhere."""
        out = self.stage.run(step.seqs, lambda seqs: self._prepare(dataclasses.replace(step, seqs=seqs)),
                             self.cache.kv_caches)
        if out is None:
            return StepOutput(torch.empty(0, self.config.hf_config.vocab_size))
        last, scoring = out
        return StepOutput(self.model.compute_logits(last).float(), self._prompt_scores(step, scoring))

    def _prompt_scores(self, step: StepInput, hidden: torch.Tensor):
        """`StepOutput.prompt_scores`; `hidden` holds every scored token's predecessor, in step
        order."""
        wanted = [(s, s.score_targets) for s in step.seqs if s.prompt_logprobs is not None]
        targets = [t for _, ts in wanted for t in ts]
        num_top = [s.prompt_logprobs for s, ts in wanted for _ in ts]
        driver = parallel.rank() == 0
        scores: list[SampleResult] = []
        chunk = step.logit_chunk_rows
        for c in range(0, len(targets), chunk):
            # NOTE: chunks may span sequences; each is reduced to scores before the next exists.
            logits = self.model.compute_logits(hidden[c : c + chunk])
            if driver:
                scores.extend(score_tokens(logits, targets[c : c + chunk], num_top[c : c + chunk]))
        out: list[list[SampleResult] | None] = []
        pos = 0
        for s in step.seqs:
            if s.prompt_logprobs is None or not driver:
                out.append(None)
            else:
                n = len(s.token_ids) - 1 + (s.score_next >= 0)
                out.append(scores[pos : pos + n])
                pos += n
        return out

    def _prepare(self, step: StepInput):
        """The step's model inputs (token ids, positions), its attention metadata (the
        backend's), and the rows whose hidden states are wanted: each sequence's last token
        (its logits), then the rows that score prompt tokens (`SeqInput.score_targets`: every
        row of a sequence with prompt_logprobs but a chunk's last row that ends the prompt)."""
        ids = array("q")
        pos = array("q")
        rows = array("q")
        extra_rows = array("q")
        for s in step.seqs:
            row0, n = len(ids), len(s.token_ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start, s.start + n))
            rows.append(row0 + n - 1)
            if s.prompt_logprobs is not None:
                extra_rows.extend(range(row0, row0 + n - (s.score_next < 0)))
        rows.extend(extra_rows)
        meta = self.attn_backend.build_metadata(step.seqs, step.table_rows)
        dev = self.device
        return _tensor(ids, dev), _tensor(pos, dev), meta, _tensor(rows, dev)


def _stage_config(model_config: ModelConfig, num_layers: int) -> ModelConfig:
    """`model_config` as a stage of `num_layers` layers sees it: what sizes its KV pool."""
    # NOTE: a copy of the HF config: the cache engine counts layers from num_hidden_layers
    hf = copy.copy(model_config.hf_config)
    hf.num_hidden_layers = num_layers
    return dataclasses.replace(model_config, hf_config=hf)


def _tensor(values: array, device: torch.device) -> torch.Tensor:
    """An int64 tensor of an array('q'), with no per-element Python work."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(values, dtype=torch.int64).to(device, copy=True)
