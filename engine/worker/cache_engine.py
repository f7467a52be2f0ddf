"""Owns the KV tensors: the device pool that attention reads, and the CPU swap pool.

Both are allocated once at start-up. Per layer, K and V are block-major tensors
`[num_blocks, num_kv_heads, block_size, head_size]`, the layout `cuda_ext.ops` expects.

Layer groups (engine/core/kv_layout.py): one allocation `[2, slots, num_blocks, ...]`; layer l uses
slot s(l) of it with its group's block ids (a block id belongs to one group's table at a time),
so a block holds `slots` layers' K/V and copies and swaps move all its slots. Without windows to
free, one group of all layers: `[2, num_layers, num_blocks, ...]` as before.
"""

from __future__ import annotations

import logging

import math
import mmap

import torch

from cuda_ext import ops
from engine.core.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.core.kv_layout import KvGroup, KvLayout, kv_layout
from engine.worker.models.registry import layer_windows
from engine.worker.pool_sizing import HEADROOM, KV_SHARE, MemoryReading, human_bytes, read_memory, size_pools

logger = logging.getLogger(__name__)

GPU_SWAP_DEFAULT = 1024**3


def kv_layout_for(model: ModelConfig, cache: CacheConfig) -> KvLayout:
    """The model's KV layer groups (engine/core/kv_layout.py): its layers' windows given back when
    `free_window_blocks` and blocks are paged (the reserve baseline keeps everything)."""
    free = cache.free_window_blocks and cache.kv_allocation == "paged"
    return kv_layout(layer_windows(model.hf_config, model.num_layers), free)


def whole_layout(num_layers: int) -> KvLayout:
    """One group of every layer, no window: the layout that keeps every layer's blocks."""
    return KvLayout((KvGroup(None, tuple(range(num_layers))),), num_layers)


def bytes_per_block(model: ModelConfig, block_size: int, tp_size: int = 1, slots: int | None = None) -> int:
    """K and V of one block across its `slots` layers (default: all; this rank's KV heads)."""
    elem = torch.tensor([], dtype=model.dtype).element_size()
    slots = model.num_layers if slots is None else slots
    return 2 * slots * (model.num_kv_heads // tp_size) * block_size * model.head_size * elem


def num_blocks_from_budget(
    model: ModelConfig, cache: CacheConfig, device: torch.device, weights_bytes: int = 0, tp_size: int = 1,
    scheduler: SchedulerConfig | None = None, memory: MemoryReading | None = None, ranks: int | None = None,
    layout: KvLayout | None = None,
) -> tuple[int, int]:
    """(device blocks, CPU swap blocks) that the memory budget allows: on a GPU the device pool
    from gpu_memory_utilization, on a CPU both pools by engine/worker/pool_sizing.py's rule unless the
    flags give them. Call it once the weights are loaded (`memory`: read now, unless given).
    `ranks`: how many ranks share the machine's memory (default `tp_size`; pipeline stages too).
    `layout`: the KV layer groups (default: one group of every layer)."""
    layout = layout or whole_layout(model.num_layers)
    per_block = bytes_per_block(model, cache.block_size, tp_size, layout.slots)
    max_num_seqs = scheduler.max_num_seqs if scheduler is not None else 1
    swap = scheduler is None or scheduler.preemption_mode == "swap"
    memory = memory or read_memory()
    kv_bytes, kv_from = cache.kv_cache_memory, "--kv-cache-memory"
    if cache.num_gpu_blocks_override is not None:
        kv_bytes, kv_from = cache.num_gpu_blocks_override * per_block, "num_gpu_blocks_override"
    elif device.type == "cuda":
        kv_from = f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = total * cache.gpu_memory_utilization - used_by_others - 512 * 1024**2  # activations
        kv_bytes = max(0, int(budget // per_block)) * per_block
    swap_bytes, swap_from = cache.swap_space, "--swap-space"
    if swap_bytes is None and device.type == "cuda":
        swap_from = "the GPU default (1 GiB at most)"
        # NOTE: a GPU's swap pool is pinned host memory, so the CPU rule (a share of its KV pool)
        # would pin tens of GB; it keeps the fixed default it had (not measured on a GPU).
        swap_bytes = min(GPU_SWAP_DEFAULT, int(KV_SHARE * max(0, memory.available - HEADROOM))) if swap else 0
    sizes = size_pools(bytes_per_block=per_block, block_size=cache.block_size, max_model_len=model.max_model_len,
                       max_num_seqs=max_num_seqs, available=memory.available, kv_cache_memory=kv_bytes,
                       swap_space=swap_bytes, swap=swap, ranks=(ranks or tp_size) if device.type == "cpu" else 1,
                       memory=memory.describe(), kv_from=kv_from, swap_from=swap_from,
                       tables_per_seq=len(layout.groups))
    if sizes.kv_blocks < 1:
        raise ValueError("the KV cache memory budget is too small for a single block")
    logger.info("memory: weights %s, KV pool %s (%d blocks), swap pool %s (%d blocks); %s",
                human_bytes(weights_bytes), human_bytes(sizes.kv_bytes), sizes.kv_blocks, human_bytes(sizes.swap_bytes),
                sizes.swap_blocks, sizes.why)
    return sizes.kv_blocks, sizes.swap_blocks


class CacheEngine:
    def __init__(self, model: ModelConfig, block_size: int, num_device_blocks: int, num_cpu_blocks: int,
                 device: torch.device, tp_size: int = 1, layout: KvLayout | None = None):
        self.block_size = block_size
        self.device = device
        shape = (model.num_kv_heads // tp_size, block_size, model.head_size)
        layout = layout or whole_layout(model.num_layers)
        S = layout.slots
        # One allocation per pool; per-slot K and V are contiguous views of it.
        self._maps: list[mmap.mmap] = []  # the CPU pools' memory (see _zeros)
        self.device_kv = self._zeros((2, S, num_device_blocks) + shape, model.dtype, device)
        pin = device.type == "cuda"
        self.cpu_kv = (torch.zeros((2, S, max(num_cpu_blocks, 0)) + shape, dtype=model.dtype, pin_memory=True) if pin
                       else self._zeros((2, S, max(num_cpu_blocks, 0)) + shape, model.dtype, torch.device("cpu")))
        # per slot (what copies and swaps move), then per layer (what each layer reads and writes)
        self.slot_caches = [(self.device_kv[0, i], self.device_kv[1, i]) for i in range(S)]
        self.cpu_caches = [(self.cpu_kv[0, i], self.cpu_kv[1, i]) for i in range(S)]
        self.kv_caches = [self.slot_caches[layout.place(i)[1]] for i in range(model.num_layers)]
        self.bytes_per_block = bytes_per_block(model, block_size, tp_size, S)
        # NOTE: copy_blocks' pointer table (every slot's K and V) is uploaded once, here: built
        # per call, its blocking host-to-device copy would drain the GPU queue at every
        # copy-on-write step. The views above never move, so the table stays valid.
        self._key_caches = [k for k, _ in self.slot_caches]
        self._value_caches = [v for _, v in self.slot_caches]
        self._copy_table = ops.copy_blocks_table(self._key_caches, self._value_caches)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero tensor; on a CPU, over an anonymous memory map. NOTE: the kernel hands out
        an anonymous map's pages zeroed and only once written, so a pool sized for many streams
        holds memory (RSS) only for the blocks that have been used; torch.zeros would write
        every page at start-up (a 1 GiB pool was 1 GiB of RSS before the first request)."""
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        mem = mmap.mmap(-1, nbytes)
        self._maps.append(mem)  # NOTE: kept with the engine: the tensors below are views of it
        return torch.frombuffer(mem, dtype=dtype).view(shape)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._swap(self.slot_caches, self.cpu_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._swap(self.cpu_caches, self.slot_caches, pairs)

    def _swap(self, src_caches, dst_caches, pairs) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            ops.swap_blocks(sk, dk, mapping)
            ops.swap_blocks(sv, dv, mapping)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block ``src`` -> ``dst`` for each pair, in every slot, queued on
        the current stream without waiting for the GPU. Raises RuntimeError (before any copy) for
        a block id outside the pool."""
        if not pairs:
            return
        # NOTE: the mapping stays on the host: the op checks it there, then (from pinned memory)
        # uploads it asynchronously; torch.tensor(..., device="cuda") would block until the GPU
        # has drained its queue.
        mapping = torch.tensor(pairs, dtype=torch.int64)
        if self.device.type == "cuda":
            mapping = mapping.pin_memory()
        ops.copy_blocks(self._key_caches, self._value_caches, mapping, self._copy_table)
