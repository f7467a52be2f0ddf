"""The CUDA kernels' device-side guards and int64 offsets, run on the CPU through the emulator
(tests/kernels/cuda_sim): a bad index in device memory is never used (nothing outside the pool
is read or written, the next layer's cache stays intact) and is reported (cuda/kernels.h,
ErrorCode); element offsets past 2^31 address the right memory."""

from __future__ import annotations

import mmap

import pytest
import torch

from cuda_ext import reference
from tests.kernels.kernel_cases import TOLERANCES, fill_caches, poisoned_caches, random_block_tables
from tests.kernels.test_cuda_kernels_emulated import (  # noqa: F401 - sim_lib is a fixture
    run_copy_emulated, run_emulated, run_reshape_emulated, sim_lib,
)

BAD_SLOT, BAD_BLOCK_ID, BAD_CONTEXT_LEN = 1, 2, 3  # cuda::ErrorCode


def two_layer_pool(num_blocks=6, heads=2, block_size=8, head_size=64):
    """[layer, K/V, blocks, heads, block_size, head] in one allocation, as the engine has it."""
    gen = torch.Generator().manual_seed(11)
    return torch.randn(2, 2, num_blocks, heads, block_size, head_size, generator=gen)


def test_slot_past_the_pool_is_skipped_and_reported(sim_lib):
    pool = two_layer_pool()
    layer1 = pool[1].clone()
    key_cache, value_cache = pool[0, 0], pool[0, 1]
    kv = torch.randn(3, 2, 64)
    num_slots = key_cache.shape[0] * key_cache.shape[2]
    slots = torch.tensor([5, num_slots, -1])  # num_slots: the first slot of the next layer's K
    expected_k = key_cache.clone()
    expected_k[0, :, 5] = kv[0]

    assert run_reshape_emulated(sim_lib, kv, kv, key_cache, value_cache, slots) == BAD_SLOT
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(pool[1], layer1), "wrote into the next layer's cache"


def test_copy_pair_outside_the_pool_is_skipped_and_reported(sim_lib):
    pool = two_layer_pool()
    caches = [pool[0, 0], pool[0, 1]]
    layer1 = pool[1].clone()
    mapping = torch.tensor([[1, 2], [0, 6], [-1, 3]])  # only the first pair is valid
    expected = [c.clone() for c in caches]
    for c in expected:
        c[2] = c[1]

    assert run_copy_emulated(sim_lib, caches, mapping) == BAD_BLOCK_ID
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))
    assert torch.equal(pool[1], layer1), "wrote into the next layer's cache"


def attention_case(context_lens, block_size=16, heads=(8, 2), head_size=64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    key_cache, value_cache = poisoned_caches(num_blocks, heads[1], block_size, head_size, torch.float32, "cpu")
    tables = random_block_tables(context_lens, block_size, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, context_lens, gen)
    query = torch.randn(len(context_lens), heads[0], head_size, generator=gen)
    return query, key_cache, value_cache, tables


@pytest.mark.parametrize("lens", [[40, 30], [40, 700]], ids=["one-partition", "split"])
def test_block_id_outside_the_pool_is_reported(sim_lib, lens):
    """The bad sequence's output is neutral (no read outside the pool); the others are right."""
    query, key_cache, value_cache, tables = attention_case(lens)
    tables[1, 1] = key_cache.shape[0] + 1000
    out, expected = torch.full_like(query, 5.0), torch.empty_like(query)
    lens_t = torch.tensor(lens, dtype=torch.int32)

    assert run_emulated(sim_lib, out, query, key_cache, value_cache, tables, lens_t, 0.125, max(lens)) == BAD_BLOCK_ID
    reference.paged_attention(expected[:1], query[:1], key_cache, value_cache, tables[:1], lens_t[:1], 0.125, 40)
    torch.testing.assert_close(out[0], expected[0], **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("lens", "max_context_len"), [
    ([600, 20], 512),  # longer than max_context_len: once silently cut at 512 tokens
    ([40, 20], 30),    # longer than max_context_len, inside one partition and its block table
    ([20, -3], 20),    # negative
])
def test_context_len_out_of_range_is_reported(sim_lib, lens, max_context_len):
    query, key_cache, value_cache, tables = attention_case([max(n, 0) for n in lens])
    out = torch.full_like(query, 5.0)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    code = run_emulated(sim_lib, out, query, key_cache, value_cache, tables, lens_t, 0.125, max_context_len)
    assert code == BAD_CONTEXT_LEN
    assert not out.isnan().any(), "read past a context"


def test_context_len_past_its_block_table_is_reported(sim_lib):
    query, key_cache, value_cache, tables = attention_case([30, 10])
    narrow = tables[:, :1].contiguous()  # one block of 16 tokens per row, 30 claimed
    out = torch.full_like(query, 5.0)
    lens_t = torch.tensor([30, 10], dtype=torch.int32)
    assert run_emulated(sim_lib, out, query, key_cache, value_cache, narrow, lens_t, 0.125, 30) == BAD_CONTEXT_LEN


def sparse_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over anonymous memory that the kernel allocates page by page as it is touched,
    so a pool of more than 2^31 elements costs only the pages a test uses."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    return torch.frombuffer(buf, dtype=dtype)


def test_offsets_past_2_pow_31_elements(sim_lib):
    """A bf16 pool of 2^31 + 16K elements per cache; the sequences' blocks sit at its top end,
    where element offsets overflow int32. reshape_and_cache writes there and attention reads
    there, both as the reference does."""
    block_size, heads, head_size = 16, 1, 128
    per_block = heads * block_size * head_size
    num_blocks = 2**31 // per_block + 8
    shape = (num_blocks, heads, block_size, head_size)
    key_cache = sparse_tensor(num_blocks * per_block, torch.bfloat16).view(shape)
    value_cache = sparse_tensor(num_blocks * per_block, torch.bfloat16).view(shape)
    lens = [40, 100]
    tables = torch.tensor([[num_blocks - 1, num_blocks - 3, num_blocks - 8, 0, 0, 0, 0],
                           [num_blocks - 2, num_blocks - 4, num_blocks - 5, num_blocks - 6, num_blocks - 7, 0, 1]],
                          dtype=torch.int32)
    assert tables[:, 0].long().min() * per_block >= 2**31
    gen = torch.Generator().manual_seed(5)
    slots = torch.cat([tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for i, n in enumerate(lens)])
    k = torch.randn(len(slots), heads, head_size, generator=gen).bfloat16()
    v = torch.randn(len(slots), heads, head_size, generator=gen).bfloat16()

    assert run_reshape_emulated(sim_lib, k, v, key_cache, value_cache, slots) == 0
    assert torch.equal(key_cache[num_blocks - 1, 0, 3], k[3, 0])  # token 3: block 0 of sequence 0, slot 3

    query = torch.randn(2, 4, head_size, generator=gen).bfloat16()
    out, expected = torch.empty_like(query), torch.empty_like(query)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    assert run_emulated(sim_lib, out, query, key_cache, value_cache, tables, lens_t, head_size**-0.5, 100) == 0
    reference.paged_attention(expected, query, key_cache, value_cache, tables, lens_t, head_size**-0.5, 100)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])
