"""`EngineArgs`: everything a user or the CLI may set, flat, and `create_engine_config`, which
resolves the model, reads its HF config, picks the dtype and step budgets and returns the
frozen, validated `EngineConfig` (engine/core/config.py).

NOTE: apart from the config dataclasses because building them looks at the model (its files,
its architecture's linear shapes, the linear kernels): the configs themselves, which the
scheduler and the block manager read, must not import the model code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from engine.core.config import (
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_size,
)
from engine.worker.models import linear_kernel
from engine.worker.models.registry import check_config, model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# NOTE: the step budget with chunked prefill, measured on a 2-core CPU (SmolLM2-135M, the
# benchmarks/compare_llama_cpp.py workload; docs/using.md has the figures): 256 tokens cut ITL
# p99 from 300 to 209 ms at 64 streams and from 168 to 151 at 16, throughput within the runs'
# spread; 384-2,048 cut it less. On a GPU a 256-token step leaves the device idle; 2,048 is
# vLLM's default for online serving there (not measured here).
CPU_CHUNKED_BUDGET = 256
GPU_CHUNKED_BUDGET = 2048

# NOTE: the step-time target on a CPU, measured like the budget above (2-core AVX2 EPYC, README
# Performance): 200 ms cut ITL p99 at 16 streams from ~450 to ~214 ms, throughput within the
# runs' spread, TTFT p50 ~390 -> ~530 ms; at 64 streams (decodes alone take ~180 ms there) the
# backlog keeps lifting the cap and nothing changed beyond noise. 150 ms: ITL p99 170, TTFT 852
# and -7% throughput at 16. Not measured on a GPU, where steps are short: off there.
CPU_TARGET_ITL_MS = 200.0
DEFAULT_TARGET_TTFT_MS = 1000.0


def step_targets(chunked: bool, device: torch.device, itl_ms: float | None,
                 ttft_ms: float | None) -> tuple[float | None, float | None]:
    """(target_itl_ms, target_ttft_ms) for SchedulerConfig: None picks the default (on a CPU
    with chunked prefill 200 ms and 1 s, else off), 0 turns each off."""
    for name, value in (("target_itl_ms", itl_ms), ("target_ttft_ms", ttft_ms)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise ValueError(f"{name} must be a number of milliseconds >= 0 (0: off), got {value}")
    if itl_ms is None:
        itl_ms = CPU_TARGET_ITL_MS if chunked and device.type == "cpu" else 0
    if ttft_ms is None:
        ttft_ms = DEFAULT_TARGET_TTFT_MS
    if not itl_ms or not chunked:
        return None, None
    return float(itl_ms), float(ttft_ms) if ttft_ms else None


def default_batched_tokens(chunked: bool, device: torch.device, max_model_len: int, max_num_seqs: int) -> int:
    """max_num_batched_tokens when none is given: with chunked prefill the measured budget for
    the device, else room for a whole prompt (max_model_len, at least 2,048); never below
    max_num_seqs (every running sequence decodes each step)."""
    if not chunked:
        return max(max_model_len, 2048, max_num_seqs)
    return max(GPU_CHUNKED_BUDGET if device.type == "cuda" else CPU_CHUNKED_BUDGET, max_num_seqs)


@dataclass
class EngineArgs:
    """Everything a user may set, flat, in vLLM's spelling where the meaning matches."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on a CPU bf16 where native and faster, else float32
    linear_kernel: str = "auto"  # auto: the fastest of torch / oneDNN / panels here (engine/worker/models/linear_kernel.py)
    quantization: str = "auto"  # auto: a GGUF's quantized tensors as stored, an fp checkpoint dense; none; q8_0|q4_0|q4_k
    fused_ops: bool = True  # CPU: residual+RMSNorm, rotary, SiLU*up as compiled one-pass ops, and with the panels
    # (fp32) or oneDNN (fp32, bf16) kernel the decoder layers as one compiled call per step (False: torch's ops)
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # None: sized from the model and the machine (engine/worker/pool_sizing.py)
    gpu_memory_utilization: float = 0.9
    swap_space: float | None = None  # GiB; None: sized like the KV pool (engine/worker/pool_sizing.py)
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    free_window_blocks: bool = True  # CacheConfig.free_window_blocks
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    preemption_mode: str = "swap"
    max_preemptions_per_request: int = 8
    enable_chunked_prefill: bool = True
    target_itl_ms: float | None = None  # None: 200 on a CPU with chunked prefill, else off; 0: off
    target_ttft_ms: float | None = None  # None: 1000; 0: no request is exempt for its wait
    scheduling_policy: str = "shortest-prompt"  # or "fcfs" (engine/sched/admission_order.py, docs/using.md)
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None  # None: one per stage
    extra: dict = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from engine.worker.models.loader import load_hf_config, resolve_model

        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_allocation not in ("paged", "reserve"):
            raise ValueError(f"kv_allocation must be 'paged' or 'reserve', got {self.kv_allocation!r}")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.swap_space is not None and not self.swap_space >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be at least 1")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ValueError("pipeline_micro_batches must be at least 1")

        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.linear_kernel not in linear_kernel.KERNELS:
            raise ValueError(f"linear_kernel must be one of {', '.join(linear_kernel.KERNELS)}; "
                             f"got {self.linear_kernel!r}")

        path, default_name = resolve_model(self.model, self.load_format, self.quantization)
        hf_config = load_hf_config(path)
        quantization = self.quantization
        if quantization == "auto" and not path.endswith(".gguf"):
            quantization = "none"  # an fp checkpoint (or dummy weights) stays dense
        model_max = getattr(hf_config, "max_position_embeddings", 2048)
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's maximum {model_max}")
        max_model_len = check_config(hf_config, max_model_len, max_model_len_asked=self.max_model_len is not None)
        if self.dtype != "auto":
            dtype = _DTYPES[self.dtype]
        elif device.type == "cuda":
            dtype = torch.bfloat16
        elif path.endswith(".gguf") and quantization != "none":
            # NOTE: weights kept quantized: the dtype is the activations' and the KV cache's, and
            # the dense layers' timing probe says nothing of the quantized kernels (while its
            # weights of every dense shape would raise the peak memory by ~140 MB for a 135M model)
            bf16 = linear_kernel.native_bf16()
            dtype = torch.bfloat16 if bf16 else torch.float32
            logger.info("dtype auto: %s (quantized weights; %s)", str(dtype).removeprefix("torch."),
                        "this CPU computes bf16 natively: half the KV cache's bytes" if bf16
                        else "no native bf16 on this CPU")
        else:
            # NOTE: on the meta device: the probe needs the linear layers' shapes, not weights
            with torch.device("meta"):
                shapes_only = model_class(hf_config)(hf_config, max_model_len)
            dtype, why = linear_kernel.choose_cpu_dtype(shapes_only)
            logger.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
        max_batched = self.max_num_batched_tokens or default_batched_tokens(
            self.enable_chunked_prefill, device, max_model_len, self.max_num_seqs)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_batched}")
        if max_batched < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be at least max_num_seqs ({self.max_num_seqs}), "
                "so that every running sequence can decode in one step"
            )
        if max_batched < max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be at least max_model_len ({max_model_len}), "
                "since a prompt is prefilled in one step (unless enable_chunked_prefill is on)"
            )
        model = ModelConfig(
            path=path,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            load_format=self.load_format,
            served_model_name=self.served_model_name or default_name,
            tokenizer=self.tokenizer,
            seed=self.seed,
            linear_kernel=self.linear_kernel,
            fused_ops=self.fused_ops,
            quantization=quantization,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=int(self.swap_space * 1024**3) if self.swap_space is not None else None,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_allocation=self.kv_allocation,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            free_window_blocks=self.free_window_blocks,
        )
        itl_ms, ttft_ms = step_targets(self.enable_chunked_prefill, device, self.target_itl_ms, self.target_ttft_ms)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,
            max_preemptions_per_request=self.max_preemptions_per_request,
            enable_chunked_prefill=self.enable_chunked_prefill,
            target_itl_ms=itl_ms,
            target_ttft_ms=ttft_ms,
            scheduling_policy=self.scheduling_policy,
        )
        return EngineConfig(model, cache, scheduler, device, self.tensor_parallel_size, self.pipeline_parallel_size,
                            self.pipeline_micro_batches)
