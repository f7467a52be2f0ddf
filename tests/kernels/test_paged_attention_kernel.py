"""paged_attention (compiled CPU / CUDA) against the pure-torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ext import build, ops, reference
from tests.kernels.kernel_cases import (
    DEVICES, TOLERANCES, fill_caches, poisoned_caches, random_block_tables, require_compiled,
)

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 128]
BLOCK_SIZES = [1, 8, 16, 32]
# (num_heads, num_kv_heads): GQA ratios 1, 3 (SmolLM2: 9 / 3) and 8.
HEAD_LAYOUTS = [(4, 4), (9, 3), (16, 2)]
# One batch mixes short, block-boundary, partition-boundary (512) and long contexts.
CONTEXT_LENS = [1, 7, 16, 33, 513, 2048]


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def run_both(query, key_cache, value_cache, block_tables, context_lens, scale):
    lens = torch.tensor(context_lens, dtype=torch.int32, device=query.device)
    out = torch.empty_like(query)
    expected = torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache, block_tables, lens, scale, max(context_lens))
    reference.paged_attention(expected, query, key_cache, value_cache, block_tables, lens, scale,
                              max(context_lens))
    return out, expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_matches_reference(device, dtype, head_size, block_size, heads):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(hash((head_size, block_size, heads)) % 2**31)
    num_blocks = sum(-(-n // block_size) for n in CONTEXT_LENS) + 3
    key_cache, value_cache = poisoned_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, device)
    tables = random_block_tables(CONTEXT_LENS, block_size, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, CONTEXT_LENS, gen)
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_size, generator=gen).to(dtype).to(device)

    out, expected = run_both(query, key_cache, value_cache, tables.to(device), CONTEXT_LENS, head_size**-0.5)

    assert not out.isnan().any(), "read a slot outside some sequence's context"
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_and_out(device):
    """The engine slices q out of a fused qkv projection: query/out need not be contiguous."""
    gen = torch.Generator().manual_seed(1)
    lens = [5, 600]
    key_cache, value_cache = poisoned_caches(60, 3, 16, 64, torch.float32, device)
    tables = random_block_tables(lens, 16, 60, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    qkv = torch.randn(2, 15, 64, generator=gen).to(device)
    query = qkv[:, :9]
    out_wide = torch.zeros(2, 12, 64, device=device)
    out = out_wide[:, 1:10]
    expected = torch.empty(2, 9, 64, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    ops.paged_attention(out, query, key_cache, value_cache, tables.to(device), lens_t, 0.125, 600)
    reference.paged_attention(expected, query, key_cache, value_cache, tables.to(device), lens_t, 0.125, 600)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    assert (out_wide[:, 0] == 0).all() and (out_wide[:, 10:] == 0).all(), "wrote outside out"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(24, 2), (6, 3), (14, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_group_sizes_between_instantiations(device, heads):
    """The CUDA kernel handles a GQA group in chunks of 1, 4 or 8 query heads: groups of 2 and 7
    leave a chunk part-empty, and 12 needs two chunks (8 + 4)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(num_heads)
    lens = [3, 700]
    key_cache, value_cache = poisoned_caches(60, num_kv_heads, 16, 64, torch.bfloat16, device)
    tables = random_block_tables(lens, 16, 60, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(2, num_heads, 64, generator=gen).bfloat16().to(device)
    out, expected = run_both(query, key_cache, value_cache, tables.to(device), lens, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_context_gives_zeros(device):
    key_cache, value_cache = poisoned_caches(4, 2, 8, 64, torch.float32, device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    key_cache[0, :, :3] = 1.0
    value_cache[0, :, :3] = 2.0
    query = torch.randn(2, 4, 64, device=device)
    out = torch.full_like(query, 7.0)
    lens = torch.tensor([0, 3], dtype=torch.int32, device=device)
    ops.paged_attention(out, query, key_cache, value_cache, tables, lens, 0.125, 3)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1], torch.full_like(out[1], 2.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("block_size", [1, 6, 16])
@pytest.mark.parametrize("heads", [(8, 4), (32, 1), (80, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_cpu_tiles_of_tokens(dtype, head_size, block_size, heads):
    """The CPU kernel's vector paths (AVX2 or AVX-512, rows of up to 512 bytes) read 8 tokens
    at a time (4 for fp32 head 128 on AVX2; bf16 pairs of them on AVX512_BF16) and run one
    prefetch stream across a thread's tasks: contexts around both tiles' ends, many sequences
    (a thread's next task), head 32 (not built for CUDA), groups of 32 and 80 query heads on one
    KV head, and a block size that is not a power of two (rows found by division)."""
    num_heads, num_kv_heads = heads
    lens = [1, 7, 8, 9, 15, 17, 100, 3, 64, 31, 4, 5, 12]
    gen = torch.Generator().manual_seed(head_size * 1000 + block_size + num_heads)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache, value_cache = poisoned_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, "cpu")
    tables = random_block_tables(lens, block_size, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    out, expected = run_both(query, key_cache, value_cache, tables, lens, head_size**-0.5)
    assert not out.isnan().any(), "read a slot outside some sequence's context"
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


AVX2_RUN = """
import sys, torch
sys.path.insert(0, {repo!r})
from cuda_ext import build, ops
from tests.kernels import test_paged_attention_kernel as t
assert ops.backend() == "cpu"
for dtype in t.DTYPES:
    for head_size in (32, 64, 128):
        for block_size in (1, 6, 16):
            t.test_cpu_tiles_of_tokens(dtype, head_size, block_size, (8, 4))
print(build.load("cpu"))
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "avx512f"} <= (build._cpuinfo_flags() or set()),
                    reason="the native build already is the AVX2 path (or this CPU cannot run it)")
def test_avx2_path_where_the_native_build_takes_avx512():
    """On an AVX-512 CPU the native build runs attention_avx512.h, so the AVX2 path (what an
    AVX2-only CPU runs) is tested in a build for x86-64-v3 (its own cache entry, kept between runs)."""
    env = {**os.environ, build.CPU_ARCH_ENV: "x86-64-v3", "PAGED_SERVE_OPS": "compiled"}
    result = subprocess.run([sys.executable, "-c", AVX2_RUN.format(repo=str(REPO))], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].endswith(build.source_hash("cpu", "x86-64-v3"))


def test_head_size_outside_instantiations_runs_on_cpu():
    """The CPU kernel has a generic path for head sizes it does not specialise."""
    gen = torch.Generator().manual_seed(2)
    lens = [3, 40]
    key_cache, value_cache = poisoned_caches(10, 2, 8, 80, torch.bfloat16, "cpu")
    tables = random_block_tables(lens, 8, 10, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(2, 6, 80, generator=gen).bfloat16()
    out, expected = run_both(query, key_cache, value_cache, tables, lens, 80**-0.5)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    lens = [9, 20]
    key_cache, value_cache = poisoned_caches(8, 2, 8, 64, torch.float32, "cpu")
    tables = random_block_tables(lens, 8, 8, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    args = (torch.empty(2, 4, 64), torch.randn(2, 4, 64, generator=gen), key_cache, value_cache, tables,
            torch.tensor(lens, dtype=torch.int32), 0.125, 20)
    torch.library.opcheck(ops.compiled_library().paged_attention.default, args)


@pytest.mark.parametrize(("table", "context_len", "message"), [
    ([[9]], 3, "block id 9 out of range"),
    ([[0]], 20, "does not fit its block table"),
])
def test_bad_block_table_is_an_error_on_cpu(table, context_len, message):
    key_cache = torch.zeros(4, 1, 8, 64)
    query = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(torch.empty_like(query), query, key_cache, key_cache,
                            torch.tensor(table, dtype=torch.int32),
                            torch.tensor([context_len], dtype=torch.int32), 1.0, context_len)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_context_on_the_split_path(device):
    """max_context_len > 512 takes the two-pass path: an empty context there gives zeros (the
    reduce kernel writes them), next to split and single-partition contexts."""
    gen = torch.Generator().manual_seed(9)
    lens = [0, 1300, 0, 7]
    key_cache, value_cache = poisoned_caches(100, 2, 16, 128, torch.bfloat16, device)
    tables = random_block_tables(lens, 16, 100, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(len(lens), 8, 128, generator=gen).bfloat16().to(device)
    out, expected = run_both(query, key_cache, value_cache, tables.to(device), lens, 128**-0.5)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("context_len", [8192, 10000])
def test_long_contexts(device, context_len):
    """8K+ tokens: 16+ partitions, a partly filled last one, next to a short sequence."""
    gen = torch.Generator().manual_seed(context_len)
    lens = [context_len, 5]
    num_blocks = sum(-(-n // 16) for n in lens) + 2
    key_cache, value_cache = poisoned_caches(num_blocks, 2, 16, 128, torch.bfloat16, device)
    tables = random_block_tables(lens, 16, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(2, 8, 128, generator=gen).bfloat16().to(device)
    out, expected = run_both(query, key_cache, value_cache, tables.to(device), lens, 128**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_large_batch(device):
    """512 sequences of mixed lengths (llama-3-8b's heads: 32 query / 8 KV, head size 128)."""
    gen = torch.Generator().manual_seed(12)
    lens = torch.randint(1, 700, (512,), generator=gen).tolist()
    num_blocks = sum(-(-n // 16) for n in lens) + 2
    key_cache, value_cache = poisoned_caches(num_blocks, 8, 16, 128, torch.bfloat16, device)
    tables = random_block_tables(lens, 16, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(len(lens), 32, 128, generator=gen).bfloat16().to(device)
    out, expected = run_both(query, key_cache, value_cache, tables.to(device), lens, 128**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=DEVICES[1].marks)])
def test_pool_past_2_pow_31_elements(device):
    """A real bf16 pool of 2^31 + 16K elements per cache (4 GiB each) on the GPU, the sequences'
    blocks at its top end, written by reshape_and_cache and read by paged_attention."""
    per_block, num_blocks = 16 * 128, 2**31 // (16 * 128) + 8
    key_cache = torch.zeros(num_blocks, 1, 16, 128, dtype=torch.bfloat16, device=device)
    value_cache = torch.zeros_like(key_cache)
    gen = torch.Generator().manual_seed(13)
    lens = [40, 100]
    top = num_blocks - 1
    tables = torch.tensor([[top, top - 2, top - 7, 0, 0, 0, 0], [top - 1, top - 3, top - 4, top - 5, top - 6, 0, 1]],
                          dtype=torch.int32)
    assert tables[:, 0].long().min() * per_block >= 2**31
    slots = torch.cat([tables[i, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16 for i, n in enumerate(lens)])
    k = torch.randn(len(slots), 1, 128, generator=gen).bfloat16().to(device)
    v = torch.randn(len(slots), 1, 128, generator=gen).bfloat16().to(device)
    ops.reshape_and_cache(k, v, key_cache, value_cache, slots.to(device))
    assert torch.equal(key_cache[top, 0, 3], k[3, 0])
    query = torch.randn(2, 4, 128, generator=gen).bfloat16().to(device)
    out, expected = run_both(query, key_cache, value_cache, tables.to(device), lens, 128**-0.5)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])
    ops.check_device_errors()
