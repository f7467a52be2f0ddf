"""The compiled ops refuse bad arguments with a clear RuntimeError, the same on both backends
(cuda_ext/csrc/checks.h): slots past the pool, block ids outside it (tables, copy and swap
mappings), contexts longer than max_context_len or their block table, dtypes, and zero divisors
(0 KV heads, 0 blocks) that once were a SIGFPE. On CUDA, the same bad indices in device memory
are skipped by the kernels and raised at the next call (ops.check_device_errors at once)."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops
from tests.kernels.kernel_cases import DEVICES, require_compiled

CUDA_ONLY = DEVICES[1].marks


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def caches(device, num_blocks=4, heads=2, block_size=8, head_size=64, dtype=torch.float32):
    shape = (num_blocks, heads, block_size, head_size)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def attend(device, tables, lens, max_context_len, kc=None, vc=None, heads=4):
    kc, vc = (kc, vc) if kc is not None else caches(device)
    query = torch.zeros(len(lens), heads, kc.shape[3], dtype=kc.dtype, device=device)
    ops.paged_attention(torch.empty_like(query), query, kc, vc, torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32), 1.0, max_context_len)


# ------------------------------------------------------------------ reshape_and_cache
@pytest.mark.parametrize("device", DEVICES)
def test_slot_past_the_pool_is_an_error(device):
    pool = torch.zeros(2, 2, 4, 2, 8, 64, device=device)  # [layer, K/V, blocks, ...]: one allocation
    kc, vc = pool[0, 0], pool[0, 1]
    kv = torch.ones(2, 2, 64, device=device)
    with pytest.raises(RuntimeError, match=r"slot 32 of token 1 out of range \(32 slots\)"):
        ops.reshape_and_cache(kv, kv, kc, vc, torch.tensor([3, 32]))  # the mapping on the host
    assert not pool.any(), "wrote before refusing"


@pytest.mark.parametrize("device", DEVICES)
def test_value_cache_dtype_is_checked(device):
    kc, _ = caches(device)
    vc = torch.zeros_like(kc, dtype=torch.float16)
    kv = torch.ones(1, 2, 64, device=device)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        ops.reshape_and_cache(kv, kv, kc, vc, torch.tensor([0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 0, 8, 64), (0, 2, 8, 64)], ids=["0-kv-heads", "0-blocks"])
def test_empty_caches_are_an_error_not_a_sigfpe(device, shape):
    kc, vc = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    query = torch.zeros(1, 4, 64, device=device)
    with pytest.raises(RuntimeError, match="at least one block, KV head"):
        ops.paged_attention(torch.empty_like(query), query, kc, vc, torch.zeros(1, 1, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), 1.0, 0)
    kv = torch.zeros(1, shape[1], 64, device=device)
    with pytest.raises(RuntimeError, match="at least one block, KV head"):
        ops.reshape_and_cache(kv, kv, kc, vc, torch.tensor([-1]))


# ------------------------------------------------------------------ paged_attention
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("tables", "lens", "max_len", "message"), [
    ([[9]], [3], 3, "block id 9 out of range"),
    ([[-1]], [3], 3, "block id -1 out of range"),
    ([[0]], [20], 20, "max_context_len 20 does not fit its block table of 1 blocks of 8 tokens"),
    ([[0, 1]], [12], 8, "context_len 12 outside \\[0, max_context_len=8\\]"),  # was cut silently
    ([[0, 1]], [-2], 8, "context_len -2 outside"),
])
def test_bad_tables_are_an_error(device, tables, lens, max_len, message):
    with pytest.raises(RuntimeError, match=message):
        attend(device, tables, lens, max_len)


@pytest.mark.parametrize("device", DEVICES)
def test_num_heads_not_a_multiple_of_kv_heads(device):
    kc, vc = caches(device, heads=3)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads 3"):
        attend(device, [[0]], [1], 1, kc, vc, heads=4)


# ------------------------------------------------------------------ copy / swap
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [(0, 4), (4, 0), (-1, 2)])
def test_copy_mapping_outside_the_pool_is_an_error(device, pair):
    kc, vc = caches(device)
    kc[0] = 1.0
    with pytest.raises(RuntimeError, match="block id out of range in block_mapping row 1"):
        ops.copy_blocks([kc], [vc], torch.tensor([[0, 1], list(pair)]))
    assert not kc[1].any(), "copied before refusing"


@pytest.mark.parametrize("device", DEVICES)
def test_swap_mapping_outside_the_pool_is_an_error(device):
    src, _ = caches(device)
    dst = torch.zeros(2, 2, 8, 64)
    with pytest.raises(RuntimeError, match="block id out of range in block_mapping row 0"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 2]]))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_table(device):
    """The pointer table built once (as the engine's CacheEngine keeps it) copies like a call
    without one; a table made for other caches is refused."""
    layers = [caches(device) for _ in range(3)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    for i, (k, v) in enumerate(layers):
        k[1], v[1] = i + 1.0, -(i + 1.0)
    table = ops.copy_blocks_table(keys, values)
    assert (table.device_ptrs is not None) == (device == "cuda" and ops.backend() == "cuda")
    mapping = torch.tensor([[1, 3]])
    ops.copy_blocks(keys, values, mapping.pin_memory() if device == "cuda" else mapping, table)
    for i, (k, v) in enumerate(layers):
        assert (k[3] == i + 1.0).all() and (v[3] == -(i + 1.0)).all()
    with pytest.raises(ValueError, match="other caches"):
        ops.copy_blocks(keys[:2], values[:2], mapping, table)


# ------------------------------------------------------------------ CUDA: device-resident indices
def expect_device_error(message):
    with pytest.raises(RuntimeError, match=message):
        ops.check_device_errors()
    ops.check_device_errors()  # reported once


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_ONLY)])
def test_device_slot_past_the_pool_is_skipped_and_reported(device):
    pool = torch.zeros(2, 2, 4, 2, 8, 64, device=device)
    kv = torch.ones(1, 2, 64, device=device)
    ops.reshape_and_cache(kv, kv, pool[0, 0], pool[0, 1], torch.tensor([32], device=device))
    expect_device_error("slot >= num_blocks")
    assert not pool.any(), "wrote into the next layer's cache"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_ONLY)])
def test_device_bad_table_is_reported_at_the_next_call(device):
    kc, vc = caches(device)
    query = torch.zeros(1, 4, 64, device=device)
    tables = torch.tensor([[7]], dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    ops.paged_attention(torch.empty_like(query), query, kc, vc, tables, lens, 1.0, 3)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="block id outside"):  # the next call raises
        ops.paged_attention(torch.empty_like(query), query, kc, vc, tables, lens, 1.0, 3)
    torch.cuda.synchronize()
    assert torch.ops.paged_serve.take_device_error() == 0  # the refused call launched nothing
    long_lens = torch.tensor([12], dtype=torch.int32, device=device)  # max_context_len 8: once cut silently
    ops.paged_attention(torch.empty_like(query), query, kc, vc, torch.zeros(1, 2, dtype=torch.int32, device=device),
                        long_lens, 1.0, 8)
    expect_device_error("context_len < 0 or > max_context_len")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_ONLY)])
def test_device_copy_mapping_outside_the_pool_is_reported(device):
    kc, vc = caches(device)
    ops.copy_blocks([kc], [vc], torch.tensor([[0, 9]], device=device))
    expect_device_error("block id outside")


# ------------------------------------------------------------------ how the messages are built
@pytest.mark.parametrize("device", DEVICES)
def test_messages_format_numbers_shapes_and_devices(device):
    """PS_CHECK (csrc/check_message.h) builds each message as text: numbers, shapes as
    [a, b, ...] and dtypes read as TORCH_CHECK wrote them."""
    kc, vc = caches(device)
    other = torch.zeros(3, 2, 8, 64, device=device)
    with pytest.raises(RuntimeError, match=r"got \[4, 2, 8, 64\] and \[3, 2, 8, 64\]"):
        ops.reshape_and_cache(torch.ones(1, 2, 64, device=device), torch.ones(1, 2, 64, device=device), kc, other,
                              torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"slot 40 of token 1 out of range \(32 slots\)"):
        ops.reshape_and_cache(torch.ones(2, 2, 64, device=device), torch.ones(2, 2, 64, device=device), kc, vc,
                              torch.tensor([3, 40]))


def test_checks_build_their_messages_as_text():
    """Every check in csrc goes through PS_CHECK: a TORCH_CHECK that streams a number crashed
    the process on a GPU image whose build linked its own libstdc++ (check_message.h says why)."""
    from cuda_ext import build

    offenders = [f"{path.relative_to(build.CSRC)}:{i}" for path in sorted(build.CSRC.rglob("*"))
                 if path.suffix in {".cpp", ".h", ".cu", ".cuh"} and path.name != "check_message.h"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if "TORCH_CHECK(" in line]
    assert not offenders, f"TORCH_CHECK( instead of PS_CHECK( in {offenders}"
