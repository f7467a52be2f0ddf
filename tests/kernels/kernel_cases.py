"""Shared helpers for the kernel tests: building paged caches from per-sequence K/V with
random, non-contiguous block tables, and the tolerance table."""

from __future__ import annotations

import os

import pytest
import torch

from cuda_ext import ops, reference

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]),
]

# Compiled kernel vs fp32 reference over the same (rounded) inputs: only the summation order
# and the final rounding to the output dtype differ.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def require_compiled() -> None:
    """Kernel tests must exercise the compiled ops: a silent fallback would compare the
    reference with itself. Skip only when the reference is forced on purpose."""
    if ops.backend() == "reference":
        if os.environ.get("PAGED_SERVE_OPS", "").lower() == "reference":
            pytest.skip("PAGED_SERVE_OPS=reference forces the reference")
        pytest.fail("the compiled paged_serve ops failed to build or load (see the log)")


def random_block_tables(
    context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator, pad: int = 2
) -> torch.Tensor:
    """[num_seqs, max_blocks + pad] int32 tables drawing distinct blocks in random order from a
    pool of num_blocks; entries past a sequence's last block are filled with random ids."""
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed, default=0) + pad
    assert sum(needed) <= num_blocks
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = pool[used:used + n]
        used += n
    return tables.to(torch.int32)


def poisoned_caches(
    num_blocks: int, num_kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches full of NaN: a kernel that reads a slot it should not (past a
    context, or through padding of a block table) turns its output into NaN."""
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def fill_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: list[int], gen: torch.Generator,
) -> None:
    """Write random K/V (std 1) into the slots each sequence's context occupies."""
    block_size = key_cache.shape[2]
    slots = []
    for i, n in enumerate(context_lens):
        pos = torch.arange(n)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    if not slots:
        return
    slots = torch.cat(slots)
    shape = (slots.numel(), key_cache.shape[1], key_cache.shape[3])
    k = torch.randn(shape, generator=gen).to(key_cache.dtype)
    v = torch.randn(shape, generator=gen).to(key_cache.dtype)
    reference.reshape_and_cache(k.to(key_cache.device), v.to(key_cache.device), key_cache, value_cache,
                                slots.to(key_cache.device))
