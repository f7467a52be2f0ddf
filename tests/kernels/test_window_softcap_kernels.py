"""Sliding windows and logit soft-capping in the compiled CPU attention kernels (`window`,
`softcap` of ops.paged_attention and ops.prefill_attention) against the exact torch reference,
engine/worker/window_attention.attend (HF eager semantics), computed in fp32 on the same values.

Decode: every vector path's head sizes (32, 64, 128, 256; 256 in bf16 takes the tiled paths,
in fp32 the portable loops) and a generic one (80: the portable loops), fp32 / fp16 / bf16,
contexts shorter than, equal to and longer than the window, power-of-two and other block sizes;
the slots before a sequence's window hold NaN, so a kernel that reads one fails. Prefill: fresh
prompts, chunks after cached prefixes (shorter and longer than the window), chunks longer than a
task's 24 rows, fp32 and bf16; the slots no query of a chunk sees hold NaN. The same cases run in
an x86-64-v3 (AVX2) build and, for decode, in a portable (x86-64-v2) build, where AVX-512 is the
native path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ext import build, ops, reference
from engine.worker.window_attention import attend
from tests.kernels.kernel_cases import TOLERANCES, fill_caches, poisoned_caches, random_block_tables, require_compiled

REPO = Path(__file__).resolve().parents[2]
# (window, softcap); 0 is none. A small cap (logits here are ~N(0, 1)) so that tanh bends them.
MODES = [(8, 0.0), (0, 1.5), (20, 2.0)]
DECODE_HEADS = [32, 64, 128, 256, 80]


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def poison_before(cache: torch.Tensor, table: torch.Tensor, positions: range) -> None:
    """NaN into the slots of `positions` of one sequence (a kernel must not read them)."""
    bs = cache.shape[2]
    for p in positions:
        cache[int(table[p // bs]), :, p % bs] = float("nan")


def expected_decode(query, key_cache, value_cache, tables, lens, scale, window, softcap):
    """attend() per sequence in fp32 over its whole (gathered) context."""
    out = torch.empty(query.shape, dtype=torch.float32)
    for i, n in enumerate(lens):
        k, v = reference.gather_cached_kv(key_cache, value_cache, tables[i], n)
        first = max(0, n - window) if window else 0  # attend() reads none before: keep NaN out of its products
        out[i:i + 1] = attend(query[i:i + 1].float(), k[first:].float(), v[first:].float(), n - 1, first, scale,
                              window or None, softcap or None)
    return out


def check_decode(dtype, head_size, block_size, heads, window, softcap, lens, seed=0):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache, value_cache = poisoned_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, "cpu")
    tables = random_block_tables(lens, block_size, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    if window:
        for i, n in enumerate(lens):
            for cache in (key_cache, value_cache):
                poison_before(cache, tables[i], range(max(0, n - window)))
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    scale = head_size**-0.5
    out = torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), scale,
                        max(lens), window, softcap)
    assert not out.isnan().any(), "read a slot outside some sequence's window"
    want = expected_decode(query, key_cache, value_cache, tables, lens, scale, window, softcap)
    torch.testing.assert_close(out.float(), want, **TOLERANCES[dtype])


def decode_lens(window: int) -> list[int]:
    """Contexts around the window (shorter, equal, one past, long) and around the tiles' ends."""
    w = window or 20
    return [1, 7, w - 1, w, w + 1, w + 9, 3 * w + 5, 100, 17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", DECODE_HEADS)
@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize(("window", "softcap"), MODES, ids=lambda m: str(m))
def test_decode(dtype, head_size, block_size, window, softcap):
    check_decode(dtype, head_size, block_size, (8, 2), window, softcap, decode_lens(window),
                 seed=head_size + block_size + window)


@pytest.mark.parametrize("heads", [(4, 1), (9, 3)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_decode_gemma_shapes_and_block_size_1(heads):
    """Gemma 3 1B's 4 query heads on 1 KV head of 256, window 512 (and GQA 3), blocks of 1."""
    check_decode(torch.bfloat16, 256, 1, heads, 512, 0.0, [1, 511, 512, 513, 777])
    check_decode(torch.float32, 256, 16, heads, 512, 50.0, [1, 513, 1100])


def test_decode_defaults_are_no_window_and_no_cap():
    """0 / 0 and the arguments left out give the kernel's plain attention, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    lens = [3, 40, 100]
    key_cache, value_cache = poisoned_caches(20, 2, 8, 64, torch.float32, "cpu")
    tables = random_block_tables(lens, 8, 20, gen)
    fill_caches(key_cache, value_cache, tables, lens, gen)
    query = torch.randn(3, 4, 64, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    plain, zeros = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention(plain, query, key_cache, value_cache, tables, lens_t, 0.125, 100)
    ops.paged_attention(zeros, query, key_cache, value_cache, tables, lens_t, 0.125, 100, 0, 0.0)
    assert torch.equal(plain, zeros)
    wide = torch.empty_like(query)  # a window no context outgrows: the same keys, the same floats
    ops.paged_attention(wide, query, key_cache, value_cache, tables, lens_t, 0.125, 100, 100)
    assert torch.equal(plain, wide)


@pytest.mark.parametrize(("window", "softcap"), [(-1, 0.0), (0, -1.0), (0, float("inf")), (0, float("nan"))])
def test_bad_window_or_softcap_is_refused(window, softcap):
    key_cache, value_cache = poisoned_caches(2, 1, 8, 64, torch.float32, "cpu")
    query = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="window must be >= 0 and softcap finite"):
        ops.paged_attention(torch.empty_like(query), query, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), 0.125, 1, window, softcap)


# ------------------------------------------------------------------ prefill
prefill_kernel = pytest.mark.skipif(
    not (ops.backend() != "reference" and ops.prefill_attention_available()),
    reason="the prefill kernel needs the compiled ops built for a CPU with AVX2 and FMA",
)

# chunks as (tokens, cached before): fresh prompts, a one-token chunk, chunks after prefixes shorter
# and longer than the windows, chunks of more than one task (24 rows)
PREFILL_CHUNKS = [(37, 0), (1, 30), (9, 21), (60, 70), (5, 3), (30, 0)]


def check_prefill(dtype, heads, kv_heads, head_size, block_size, window, softcap, chunks=PREFILL_CHUNKS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(n + c) // block_size) for n, c in chunks]
    blocks = sum(need) + 3
    kc = torch.randn(blocks, kv_heads, block_size, head_size, generator=gen).to(dtype)
    vc = torch.randn(blocks, kv_heads, block_size, head_size, generator=gen).to(dtype)
    perm = torch.randperm(blocks, generator=gen).tolist()
    width = max(need)
    tables, spans, first, taken = [], [], 0, 0
    for (n, c), used in zip(chunks, need):
        tables.append(perm[taken:taken + used] + [0] * (width - used))
        spans.append([first, n, c])
        first, taken = first + n, taken + used
    tables = torch.tensor(tables, dtype=torch.int32)
    q = torch.randn(first, heads + 2 * kv_heads, head_size, generator=gen)[:, :heads].to(dtype)  # strided rows
    scale = head_size**-0.5
    want = torch.empty(q.shape)
    for (row, n, cached), table in zip(spans, tables):
        k, v = reference.gather_cached_kv(kc, vc, table, cached + n)
        want[row:row + n] = attend(q[row:row + n].float(), k.float(), v.float(), cached, 0, scale, window or None,
                                   softcap or None)
        if window:  # slots no query of the chunk sees
            for cache in (kc, vc):
                poison_before(cache, table, range(max(0, cached - window + 1)))
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.prefill_attention(out, q, kc, vc, tables, torch.tensor(spans, dtype=torch.int32), scale, window, softcap)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), want, **tol)


@prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(8, 4, 32), (9, 3, 64), (4, 1, 128), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [16, 6, 1])
@pytest.mark.parametrize(("window", "softcap"), MODES + [(1, 0.0), (200, 0.0)], ids=lambda m: str(m))
def test_prefill(dtype, heads, kv_heads, head_size, block_size, window, softcap):
    check_prefill(dtype, heads, kv_heads, head_size, block_size, window, softcap, seed=head_size + window)


@prefill_kernel
def test_prefill_refuses_a_bad_window():
    q = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="window must be >= 0 and softcap finite"):
        ops.prefill_attention(torch.empty_like(q), q, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                              torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[0, 2, 0]], dtype=torch.int32),
                              0.25, -3)


# ------------------------------------------------------------------ other builds
OTHER_BUILD_RUN = """
import sys, torch
sys.path.insert(0, {repo!r})
from cuda_ext import build, ops
from tests.kernels import test_window_softcap_kernels as t
assert ops.backend() == "cpu"
for window, softcap in t.MODES:
    for dtype in (torch.float32, torch.bfloat16):
        for head_size in t.DECODE_HEADS:
            for block_size in (16, 6):
                t.check_decode(dtype, head_size, block_size, (8, 2), window, softcap, t.decode_lens(window))
        if ops.prefill_attention_available():
            for heads, kv_heads, head_size in ((9, 3, 64), (4, 1, 256)):
                t.check_prefill(dtype, heads, kv_heads, head_size, 6, window, softcap)
print(ops.prefill_attention_available())
print(build.load("cpu"))
"""


def run_other_build(arch: str, env_extra: dict) -> list[str]:
    env = {**os.environ, build.CPU_ARCH_ENV: arch, "PAGED_SERVE_OPS": "compiled", **env_extra}
    result = subprocess.run([sys.executable, "-c", OTHER_BUILD_RUN.format(repo=str(REPO))], env=env,
                            capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].endswith(build.source_hash("cpu", arch))
    return lines


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "avx512f"} <= (build._cpuinfo_flags() or set()),
                    reason="the native build already is the AVX2 path (or this CPU cannot run it)")
def test_avx2_build():
    """The AVX2 decode path (attention_avx2.h) and the prefill kernel in an x86-64-v3 build."""
    assert run_other_build("x86-64-v3", {})[-2] == "True"


@pytest.mark.skipif(build.PORTABLE_MARCH.get(build.platform.machine().lower()) != "x86-64-v2",
                    reason="the portable build is checked on x86-64")
def test_portable_build(portable_ext_cache):
    """The portable decode loops (attend_one) at every head size, in an x86-64-v2 build (no
    prefill kernel there: the backend runs its prompts in torch)."""
    assert run_other_build("portable", {"PAGED_SERVE_EXT_CACHE": str(portable_ext_cache)})[-2] == "False"
