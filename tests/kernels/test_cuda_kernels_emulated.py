"""The CUDA kernels (paged attention, reshape_and_cache, copy_blocks), run unchanged on the CPU through a small CUDA emulator
(tests/kernels/cuda_sim), against the reference. This checks their indexing, GQA chunking,
partition split and reduction, and barrier/shuffle discipline on machines without a GPU; real
GPU runs are scripts/gpu_check.sh. Needs a C++20 compiler and the CUDA headers (nvcc's)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from cuda_ext import build, reference
from tests.kernels.kernel_cases import TOLERANCES, fill_caches, poisoned_caches, random_block_tables

SIM_DIR = Path(__file__).resolve().parent / "cuda_sim"
CUDA_DIR = build.CSRC / "cuda"
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# (dtype, head_size, (num_heads, num_kv_heads), block_size, context_lens): each GQA chunking
# (1, 4, 8 and 8 + 4 heads per block, a group of 2 or 3 in a 4-head block), single and split
# contexts, an empty context.
CASES = [
    (torch.float32, 64, (4, 4), 16, [5, 600]),
    (torch.bfloat16, 128, (8, 2), 16, [0, 33, 1100]),
    (torch.float16, 64, (24, 2), 8, [17, 513]),
    (torch.bfloat16, 64, (9, 3), 1, [1, 40]),
    (torch.float32, 128, (16, 2), 32, [300]),
    (torch.float16, 64, (8, 4), 12, [7, 530]),  # a block size that is no power of two: divisions
]


def cuda_include() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc and (Path(nvcc).resolve().parents[1] / "include" / "cuda_fp16.h").exists():
        return Path(nvcc).resolve().parents[1] / "include"
    return None


@pytest.fixture(scope="module")
def sim_lib() -> ctypes.CDLL:
    include = cuda_include()
    compiler = os.environ.get("CXX", "c++")
    if include is None or shutil.which(compiler) is None:
        pytest.skip("needs a C++ compiler and the CUDA headers")
    units = [SIM_DIR / "sim_attention.cpp", SIM_DIR / "sim_cache.cpp"]
    sources = [*units, SIM_DIR / "cuda_sim.h", *sorted(CUDA_DIR.glob("*.cuh")), CUDA_DIR / "kernels.h"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + str(include).encode()).hexdigest()[:16]
    lib_path = build.cache_root() / f"cuda_sim_{digest}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                        "-isystem", str(include), *map(str, units), "-o", str(tmp)], check=True)
        os.replace(tmp, lib_path)
    return ctypes.CDLL(str(lib_path))


def call_with_timeout(fn) -> int:
    """Run fn() (a call into the emulator) on a thread; a kernel that skips a barrier on some
    threads deadlocks in the emulator, so give up after a while."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(timeout=180)
    assert not worker.is_alive(), "emulated kernel hung: a __syncthreads or shuffle is not reached by all threads"
    return result[0]


def run_emulated(lib, out, query, key_cache, value_cache, tables, lens, scale, max_context_len) -> int:
    """Run the emulated attention kernels; returns the ErrorCode they reported (0: none)."""
    strides = (ctypes.c_int64 * 7)(query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                                   key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    ptr = ctypes.c_void_p
    error = ctypes.c_int(0)
    rc = call_with_timeout(lambda: lib.sim_paged_attention(
        ptr(out.data_ptr()), ptr(query.data_ptr()), ptr(key_cache.data_ptr()), ptr(value_cache.data_ptr()),
        ptr(tables.data_ptr()), ptr(lens.data_ptr()), DTYPE_CODES[query.dtype], query.shape[0],
        query.shape[1], key_cache.shape[1], query.shape[2], key_cache.shape[2], tables.shape[1], key_cache.shape[0],
        strides, ctypes.c_float(scale), max_context_len, ctypes.byref(error)))
    assert rc == 0, "configuration not instantiated"
    return error.value


def run_reshape_emulated(lib, key, value, key_cache, value_cache, slots) -> int:
    """Run the emulated reshape_and_cache kernel; returns the ErrorCode it reported."""
    s = (ctypes.c_int64 * 7)(key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0),
                             key_cache.stride(1), key_cache.stride(2))
    ptr = ctypes.c_void_p
    error = ctypes.c_int(0)
    rc = call_with_timeout(lambda: lib.sim_reshape_and_cache(
        ptr(key.data_ptr()), ptr(value.data_ptr()), ptr(key_cache.data_ptr()), ptr(value_cache.data_ptr()),
        ptr(slots.data_ptr()), key.shape[0], key.shape[1], key.shape[2], key_cache.shape[2], s,
        ctypes.c_int64(key_cache.shape[0] * key_cache.shape[2]), key.element_size(), ctypes.byref(error)))
    assert rc == 0
    return error.value


def run_copy_emulated(lib, caches, mapping) -> int:
    """Run the emulated copy_blocks kernel over `caches`; returns the ErrorCode it reported."""
    ptrs = (ctypes.c_int64 * len(caches))(*[c.data_ptr() for c in caches])
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    error = ctypes.c_int(0)
    rc = call_with_timeout(lambda: lib.sim_copy_blocks(
        ptrs, ctypes.c_void_p(mapping.data_ptr()), len(caches), mapping.shape[0], ctypes.c_int64(block_bytes),
        ctypes.c_int64(caches[0].shape[0]), ctypes.byref(error)))
    assert rc == 0
    return error.value


@pytest.mark.parametrize(("dtype", "head_size", "heads", "block_size", "context_lens"), CASES,
                         ids=[f"{str(c[0])[6:]}-d{c[1]}-h{c[2][0]}kv{c[2][1]}-b{c[3]}" for c in CASES])
def test_cuda_attention_kernel_emulated(sim_lib, dtype, head_size, heads, block_size, context_lens):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_size + num_heads)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    key_cache, value_cache = poisoned_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, "cpu")
    tables = random_block_tables(context_lens, block_size, num_blocks, gen)
    fill_caches(key_cache, value_cache, tables, context_lens, gen)
    query = torch.randn(len(context_lens), num_heads, head_size, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, 5.0)
    expected = torch.empty_like(query)

    assert run_emulated(sim_lib, out, query, key_cache, value_cache, tables, lens, head_size**-0.5,
                        max(context_lens)) == 0
    reference.paged_attention(expected, query, key_cache, value_cache, tables, lens, head_size**-0.5,
                              max(context_lens))

    assert not out.isnan().any(), "read a slot outside some sequence's context"
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_reshape_and_cache_kernel_emulated(sim_lib, dtype):
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_kv_heads, block_size, head_size, num_tokens = 12, 2, 8, 64, 21
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_size, generator=gen).to(dtype)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]  # strided, as sliced from qkv
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)

    assert run_reshape_emulated(sim_lib, key, value, key_cache, value_cache, slots) == 0
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_cuda_copy_blocks_kernel_emulated(sim_lib):
    gen = torch.Generator().manual_seed(8)
    caches = [torch.randn(10, 2, 8, 64, generator=gen).bfloat16() for _ in range(4)]  # 2 layers x (K, V)
    mapping = torch.tensor([[1, 7], [4, 2], [1, 9]])
    expected = [c.clone() for c in caches]
    reference.copy_blocks(expected[:2], expected[2:], mapping)

    assert run_copy_emulated(sim_lib, caches, mapping) == 0
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
