"""reshape_and_cache, copy_blocks and swap_blocks (compiled) against the reference, exactly;
gather_cached_kv against a hand-written walk of the block table."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops, reference
from tests.kernels.kernel_cases import DEVICES, require_compiled

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [1, 8, 16, 32]
HEAD_SIZES = [64, 128]


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def random_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, device, gen):
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    return (torch.randn(shape, generator=gen).to(dtype).to(device),
            torch.randn(shape, generator=gen).to(dtype).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_reshape_and_cache(device, dtype, block_size, head_size):
    gen = torch.Generator().manual_seed(block_size * 1000 + head_size)
    num_blocks, num_kv_heads, num_tokens = 40, 3, 37
    key_cache, value_cache = random_caches(num_blocks, num_kv_heads, block_size, head_size, dtype, device, gen)
    # K and V sliced out of a fused [tokens, q + k + v heads, head] projection: not contiguous.
    qkv = torch.randn(num_tokens, 9 + 2 * num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    key, value = qkv[:, 9:9 + num_kv_heads], qkv[:, 9 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)

    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_copy_blocks(device, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_layers, num_blocks = 3, 32
    layers = [random_caches(num_blocks, 2, block_size, 64, dtype, device, gen) for _ in range(num_layers)]
    key_caches, value_caches = [k for k, _ in layers], [v for _, v in layers]
    order = torch.randperm(num_blocks, generator=gen)
    # Sources and destinations disjoint (as copy-on-write produces), one source copied twice.
    mapping = torch.stack([torch.cat([order[:6], order[:1]]), order[6:13]], dim=1).to(device)
    expected_k = [k.clone() for k in key_caches]
    expected_v = [v.clone() for v in value_caches]

    ops.copy_blocks(key_caches, value_caches, mapping)
    reference.copy_blocks(expected_k, expected_v, mapping)

    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)


SWAP_DIRECTIONS = [
    ("cpu", "cpu"),
    *[pytest.param(s, d, marks=DEVICES[1].marks) for s, d in [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")]],
]


@pytest.mark.parametrize(("src_device", "dst_device"), SWAP_DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_blocks(src_device, dst_device, dtype):
    gen = torch.Generator().manual_seed(4)
    src, _ = random_caches(20, 3, 16, 64, dtype, src_device, gen)
    dst, _ = random_caches(12, 3, 16, 64, dtype, dst_device, gen)
    mapping = torch.tensor([[19, 0], [3, 11], [7, 5]])
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)

    ops.swap_blocks(src, dst, mapping)
    if "cuda" in (src_device, dst_device):
        torch.cuda.synchronize()

    assert torch.equal(dst, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_cached_kv(device):
    gen = torch.Generator().manual_seed(5)
    key_cache, value_cache = random_caches(10, 2, 4, 8, torch.float32, device, gen)
    table = [7, 2, 9, 0]
    k, v = ops.gather_cached_kv(key_cache, value_cache, table, 10)
    assert k.shape == v.shape == (10, 2, 8)
    for t in range(10):
        assert torch.equal(k[t], key_cache[table[t // 4], :, t % 4])
        assert torch.equal(v[t], value_cache[table[t // 4], :, t % 4])
    k2, _ = ops.gather_cached_kv(key_cache, value_cache, torch.tensor(table, dtype=torch.int32, device=device), 10)
    assert torch.equal(k, k2)


def test_opcheck_cache_ops():
    gen = torch.Generator().manual_seed(6)
    lib = ops.compiled_library()
    key_cache, value_cache = random_caches(6, 2, 8, 64, torch.float32, "cpu", gen)
    key, value = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([3, -1, 17, 40, 8])
    torch.library.opcheck(lib.reshape_and_cache.default, (key, value, key_cache, value_cache, slots))
    mapping = torch.tensor([[0, 4], [1, 5]])
    torch.library.opcheck(lib.copy_blocks.default, ([key_cache], [value_cache], mapping))
    dst = torch.zeros_like(key_cache)
    torch.library.opcheck(lib.swap_blocks.default, (key_cache, dst, mapping))


@pytest.mark.parametrize("device", DEVICES)
def test_cache_engine_copy(device):
    """engine.worker.cache_engine.CacheEngine.copy: the pointer table built once at start-up serves
    every copy-on-write call, in every layer; a block id outside the pool is refused first."""
    from types import SimpleNamespace

    from engine.worker.cache_engine import CacheEngine

    model = SimpleNamespace(num_layers=3, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    engine = CacheEngine(model, block_size=8, num_device_blocks=10, num_cpu_blocks=0, device=torch.device(device))
    engine.device_kv.copy_(torch.randn(engine.device_kv.shape).to(engine.device_kv))
    before = engine.device_kv.clone()
    for pairs in ([(1, 4), (2, 5)], [(4, 9)]):  # the second copies a block the first wrote
        engine.copy(pairs)
        for src, dst in pairs:
            before[:, :, dst] = before[:, :, src]
    assert torch.equal(engine.device_kv, before)
    with pytest.raises(RuntimeError, match="block id out of range"):
        engine.copy([(0, 10)])
    assert torch.equal(engine.device_kv, before)
