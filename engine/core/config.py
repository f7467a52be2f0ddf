"""Engine settings: the few frozen config dataclasses that `EngineArgs` (engine/loop/engine_args.py)
builds and validates from what a user or CLI gives. Values derived at start-up (the number of
KV blocks) live on the runtime objects, never in these configs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where the start-up caches live (converted GGUF tokenizers and models, kernel choices):
    PAGED_SERVE_CACHE, else ~/.cache/paged-serve."""
    return Path(os.environ.get("PAGED_SERVE_CACHE", Path.home() / ".cache" / "paged-serve"))


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB', '1.5G'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse a memory size from {value!r}; use e.g. 2GiB or 512MB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    power = " KMGT".index(unit) if unit else 0
    return int(number * base**power)


# --quantization: "auto" serves a GGUF's tensors as stored (none for an fp checkpoint), "none"
# dequantizes everything, a type quantizes the decoder's other linear layers to it at load
QUANTIZATIONS = ("auto", "none", "q8_0", "q5_1", "q5_0", "q4_0", "q4_k")


@dataclass(frozen=True)
class ModelConfig:
    path: str  # resolved local HF-style directory (config.json, *.safetensors, tokenizer), or a .gguf file
    hf_config: object  # transformers PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str  # "auto" | "dummy"
    served_model_name: str
    seed: int
    linear_kernel: str = "auto"  # engine/worker/models/linear_kernel.py: auto | torch | onednn | panels
    fused_ops: bool = True  # the compiled one-pass RMSNorm / rotary / SiLU*up on CPU tensors
    # "auto" (a GGUF's types as stored), "none" (dense) or a type the linear layers take at load
    quantization: str = "none"
    tokenizer: str | None = None  # a tokenizer's HF directory or .gguf (--tokenizer); None: the model's own

    @property
    def quantized(self) -> bool:
        """Whether some weights may stay quantized (a GGUF served as stored, or --quantization TYPE)."""
        return self.quantization != "none"

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_size(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory: int | None  # bytes for the device pool on CPU serving (None: engine/worker/pool_sizing.py's rule)
    gpu_memory_utilization: float  # fraction of GPU memory on CUDA
    swap_space: int | None  # bytes of CPU swap pool (None: engine/worker/pool_sizing.py's rule)
    enable_prefix_caching: bool
    kv_allocation: str  # "paged" (on demand) | "reserve" (max_model_len per sequence, baseline)
    num_gpu_blocks_override: int | None = None  # tests force a small pool
    # give back the blocks that fall out of a sliding window (engine/core/kv_layout.py); False: keep
    # every layer's blocks (the baseline of benchmarks/kv_waste.py's `window` mode)
    free_window_blocks: bool = True


SCHEDULING_POLICIES = ("fcfs", "shortest-prompt")  # engine/sched/admission_order.py


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str  # "swap" (falls back to recompute) | "recompute"
    max_preemptions_per_request: int  # starvation bound: past it a request is not preempted again
    # prefill a prompt over several steps when the budget is short (EngineArgs: on by default)
    enable_chunked_prefill: bool = False
    # with chunked prefill: cut other requests' chunks so a step with decodes takes at most this
    # long (estimated); None: no cap (engine/sched/step_cost.py)
    target_itl_ms: float | None = None
    # requests that arrived longer ago than this are exempt from that cap; None: none are
    target_ttft_ms: float | None = None
    # the order in which requests that are out come in (engine/sched/admission_order.py)
    scheduling_policy: str = "fcfs"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of contiguous decoder layers (engine/worker/pipeline_stage.py)
    pipeline_micro_batches: int | None = None  # per step and stage; None: one per stage
